"""codegen's shape: wings that import only the floors below them, and small modules.

Floors: kernel (the ground: MSL text, sizes, layouts, plans, tiles, tables, passes), then
storage (how an operand is read), then the attention family, then the families built on it
(sparse, int8), which do not import each other. The face (codegen/__init__.py) may import
every wing. Outside codegen, a wing may import only the package's value modules below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mfa_native.codegen

CODEGEN = Path(mfa_native.codegen.__file__).parent
FLOORS = {"kernel": 0, "storage": 1, "attention": 2, "sparse": 3, "int8": 3}
OUTSIDE = {"mfa_native.runtime.arrays", "mfa_native.runtime.passes", "mfa_native.runtime.templates",
           "mfa_native.runtime.expressions", "mfa_native.quant_formats"}
MAX_LINES = 300


def _modules() -> list[Path]:
    return sorted(p for p in CODEGEN.rglob("*.py") if p.parent != CODEGEN)


def _imports(path: Path) -> set[str]:
    """The absolute names of the modules `path` imports (relative imports resolved)."""
    package = "mfa_native." + ".".join(path.relative_to(CODEGEN.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("mfa_native")}


def _wing(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "codegen" else None


def test_every_module_lives_in_a_wing():
    assert {p.parent.name for p in _modules()} <= set(FLOORS)
    assert sorted(p.name for p in CODEGEN.glob("*.py")) == ["__init__.py"]


def _violations(wing: str, imports: set[str]) -> list[str]:
    """The imports a module of `wing` may not make."""
    wrong = []
    for name in sorted(imports):
        target = _wing(name)
        if target is None:
            below = any(name == o or name.startswith(o + ".") for o in OUTSIDE)
            if name.startswith("mfa_native.codegen") or not below:
                wrong.append(name)
        elif target != wing and not FLOORS.get(target, 99) < FLOORS[wing]:
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(CODEGEN)))
def test_a_wing_imports_only_lower_floors(path: Path):
    assert _violations(path.parent.name, _imports(path)) == []


def test_the_rule_catches_what_it_forbids(tmp_path):
    """An attention module importing the sparse wing, the face, an op; sparse importing int8."""
    module = tmp_path / "codegen" / "attention" / "bad.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..sparse.block_visits import BlockLists\nfrom .. import attention_source\n"
                      "from ...ops import attention\nfrom ..kernel.tiles import tiles\n")
    global CODEGEN
    real, CODEGEN = CODEGEN, tmp_path / "codegen"
    try:
        found = _imports(module)
    finally:
        CODEGEN = real
    assert _violations("attention", found) == ["mfa_native.codegen", "mfa_native.codegen.attention_source",
                                               "mfa_native.codegen.sparse.block_visits",
                                               "mfa_native.codegen.sparse.block_visits.BlockLists",
                                               "mfa_native.ops", "mfa_native.ops.attention"]
    assert _violations("sparse", {"mfa_native.codegen.int8.products"}) == ["mfa_native.codegen.int8.products"]
    assert _violations("int8", {"mfa_native.codegen.attention.rows", "mfa_native.quant_formats"}) == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(CODEGEN)))
def test_modules_stay_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(CODEGEN)} has {lines} lines (at most {MAX_LINES})"


def test_ops_never_import_the_framework_adapters():
    """The ops find a framework's adapter through runtime.frameworks' registry (each adapter
    registers itself on import), so no op module imports mfa_native.torch or mfa_native.mlx, not
    even inside a function: the ops <-> adapters circle stays broken."""
    ops = CODEGEN.parent / "ops"
    adapters = ("mfa_native.torch", "mfa_native.mlx")
    wrong = {path.name: sorted(name for name in _imports(path) if name.startswith(adapters))
             for path in sorted(ops.glob("*.py"))}
    assert {name: found for name, found in wrong.items() if found} == {}
