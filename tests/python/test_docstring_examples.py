"""The API reference's examples run as written, and every op documents what the issue asks
("every op's docstring gives its shapes, dtypes, semantics, errors and an example").

The reference (mkdocstrings, Google style) is generated from the docstrings of every name in
the `__all__` of mfa_native, mfa_native.torch and mfa_native.mlx. For each function or class
among them whose docstring has an `Example:` section, its fenced python blocks run here in this
process, one test per name, in a namespace of their own (they import what they use). Every op
(a function of mfa_native made from a declaration) and every function of the framework
adapters must have Args, Returns, Raises and an Example; every other public function and class
an Example. The examples are tiny and share shapes, so that few kernels compile on a cold cache.
And griffe, mkdocstrings' parser, reads every one of these docstrings without a warning (a
parameter the signature does not have, a Raises item that is not "SomeError: when", ...),
with the options of the site's mkdocs.yml.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import re
import textwrap

import pytest

MODULES = {"mfa_native": None, "mfa_native.torch": "torch", "mfa_native.mlx": "mlx.core"}
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
SECTION = re.compile(r"^(Args|Returns|Raises|Example):$", re.M)


def _names() -> list:
    """(module, name) of every documented public name: each module's __all__ without its
    submodules (mfa_native.reference has its own page); a module whose framework is not
    installed gives one skipped entry."""
    names = []
    for module, framework in MODULES.items():
        if framework and importlib.util.find_spec(framework.split(".")[0]) is None:
            names.append(pytest.param(module, None, marks=pytest.mark.skip(reason=f"{framework} is not installed")))
            continue
        public = importlib.import_module(module)
        names += [(module, n) for n in public.__all__ if not inspect.ismodule(getattr(public, n))]
    return names


NAMES = _names()
IDS = [f"{p[0]}.{p[1]}" if isinstance(p, tuple) else p.values[0] for p in NAMES]


def examples(obj) -> list[str]:
    """The fenced python blocks of an object's Example section (its indented lines)."""
    lines = (inspect.getdoc(obj) or "").splitlines()
    if "Example:" not in lines:
        return []
    section = []
    for line in lines[lines.index("Example:") + 1:]:
        if line.strip() and not line.startswith(" "):
            break
        section.append(line)
    return FENCE.findall(textwrap.dedent("\n".join(section)) + "\n")


def sections(obj) -> set[str]:
    return set(SECTION.findall(inspect.getdoc(obj) or ""))


def must_document(module: str, obj) -> set[str]:
    """What a public name's docstring must hold: an op (declared) or an adapter's function
    Returns, Raises, an Example and Args (if it takes arguments), any other function or class an
    Example."""
    if hasattr(obj, "declaration") or (module != "mfa_native" and inspect.isfunction(obj)):
        return {"Returns", "Raises", "Example"} | ({"Args"} if inspect.signature(obj).parameters else set())
    return {"Example"}


@pytest.mark.parametrize("module, name", NAMES, ids=IDS)
def test_the_docstring_has_its_sections(module, name):
    obj = getattr(importlib.import_module(module), name)
    missing = must_document(module, obj) - sections(obj)
    assert not missing, f"{module}.{name}'s docstring has no {', '.join(sorted(missing))} section"
    if "Example" in sections(obj):
        assert examples(obj), f"{module}.{name}: its Example section holds no ```python block"


@pytest.mark.parametrize("module, name", NAMES, ids=IDS)
def test_the_example_runs(module, name):
    obj = getattr(importlib.import_module(module), name)
    blocks = examples(obj)
    if not blocks:
        pytest.skip(f"{module}.{name} has no example")
    for block in blocks:
        exec(compile(block, f"<{module}.{name} example>", "exec"), {"__name__": "__example__"})


# The site's parser options (mkdocs.yml: docstring_style google, docstring_options).
GRIFFE_OPTIONS = {"warn_missing_types": False, "warn_unknown_params": True}


def _documented(obj) -> list:
    """A griffe object (an alias resolved) and its public members, when it is a class."""
    obj = obj.final_target if obj.is_alias else obj
    members = [m for m in obj.members.values() if not m.name.startswith("_") or m.name == "__call__"] \
        if obj.is_class else []
    return [obj] + [m for member in members for m in _documented(member)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_griffe_parses_every_docstring_without_a_warning(module, caplog):
    griffe = pytest.importorskip("griffe")
    if MODULES[module]:
        pytest.importorskip(MODULES[module])
    loaded = griffe.load(module, force_inspection=True, resolve_aliases=False)   # as mkdocstrings loads it
    public = importlib.import_module(module)
    split = []
    with caplog.at_level(logging.WARNING, logger="griffe"):
        for name in public.__all__:
            if inspect.ismodule(getattr(public, name)):
                continue
            for obj in _documented(loaded[name]):
                if obj.docstring is not None:
                    sections = obj.docstring.parse("google", **GRIFFE_OPTIONS)
                    split += [obj.path for s in sections if s.kind.value == "returns" and len(s.value) > 1]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert split == [], "a Returns section read as several items: indent its continuation lines"
