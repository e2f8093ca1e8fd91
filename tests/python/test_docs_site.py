"""The documentation as a whole (issue "Documentation a user can navigate"): a README of at most
250 lines that keeps its two set-up commands and whose links resolve; a site in docs/ whose every
page is in the navigation and linked from the index; and an API reference, generated from the
docstrings, that shows every public name of every public module. The site itself is built
strictly (a broken link or reference fails) by this test and by .ci/run."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# The public modules and the API page that documents each.
API_PAGES = {"mfa_native": "api/mfa_native.md", "mfa_native.torch": "api/torch.md",
             "mfa_native.mlx": "api/mlx.md", "mfa_native.reference": "api/reference.md"}


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, in order (read as text: the file's tags need mkdocs)."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M)


def test_readme_is_short_and_keeps_its_two_commands():
    assert len(README.splitlines()) <= 250
    assert "```bash\npip install . && python -m mfa_native demo\n```" in README
    assert "```bash\nbash scripts/run-tests.sh\n```" in README


def test_readme_links_resolve():
    targets = [t for t in LINK.findall(README) if not t.startswith(("http://", "https://"))]
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []
    linked = {t.removeprefix("docs/") for t in targets if t.startswith("docs/")}
    assert set(_nav_pages()) - {"index.md"} <= linked, "the README's documentation list misses a page"


def test_every_page_is_in_the_nav_and_linked_from_the_index():
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    nav = _nav_pages()
    assert sorted(nav) == pages and len(set(nav)) == len(nav)
    index = DOCS / "index.md"
    linked = {str((index.parent / t).resolve().relative_to(DOCS.resolve())) for t in LINK.findall(index.read_text())}
    assert set(pages) - {"index.md"} - linked == set()


def test_every_public_module_has_its_api_page():
    for module, page in API_PAGES.items():
        assert f"::: {module}\n" in (DOCS / page).read_text(), page
    listed = set(re.findall(r"`(mfa_native[\w.]*)`", (DOCS / "api/index.md").read_text()))
    assert set(API_PAGES) <= listed


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly (what .ci/run does). Not with -q: mkdocs then counts no
    warnings, and --strict passes whatever they say."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    for framework in ("torch", "mlx.core"):   # the adapters' pages import them
        pytest.importorskip(framework)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out


def test_the_api_reference_shows_every_public_name(site):
    """Each name of a public module's __all__ has its entry (an anchor mkdocstrings writes with
    the name's path) on the module's page, with its docstring's first line under it, and nothing
    else has one (no imported helper, no _private or __dunder__ member of a class); a public
    submodule in __all__ has a page of its own."""
    for module_name, page in API_PAGES.items():
        module = importlib.import_module(module_name)
        html = (site / page.removesuffix(".md") / "index.html").read_text()
        names = [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]
        assert {f"{module_name}.{n}" for n in module.__all__} - {f"{module_name}.{n}" for n in names} <= set(API_PAGES)
        missing = [n for n in names if f'id="{module_name}.{n}"' not in html]
        assert missing == [], (page, missing)
        entries = set(re.findall(rf'id="{re.escape(module_name)}\.(\w+)', html))
        assert entries == set(names), (page, "not public", sorted(entries - set(names)))
        assert not re.search(rf'id="{re.escape(module_name)}\.[\w.]*\._', html), (page, "a private or dunder member")
        for name in names:
            first_line = (getattr(module, name).__doc__ or "").strip().splitlines()[0]
            words = re.findall(r"[A-Za-z]{4,}", first_line)[:3]
            assert all(w in html for w in words), (module_name, name, words)
