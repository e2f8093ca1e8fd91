"""Documentation a new user follows (issue "Hardening", part 8): the README's snippets run, the
files it names exist in a clone, the documented `mfa_native.reference` works after a plain
`import mfa_native`, and the demo says what its first call spent time on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section titled `section` (up to the next heading of its level)."""
    level = section.split()[0]
    start = README.index(section + "\n")
    end = README.find("\n" + level + " ", start + len(section))
    text = README[start:end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_attention_and_backward_snippets_run():
    namespace: dict = {}
    for block in python_blocks("## Attention")[:1] + python_blocks("### Backward pass")[:1]:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["dq"].shape == namespace["q"].shape and namespace["dsinks"].shape == (8,)


def test_the_quantized_kv_snippet_runs():
    namespace: dict = {}
    (block,) = python_blocks("## Quantized K/V caches")
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    out, expected = (namespace[name].astype("float32") for name in ("out", "expected"))
    assert out.shape == (1, 32, 1, 128) and abs(out - expected).max() < 2e-3


def test_the_int8_attention_snippet_runs():
    namespace: dict = {}
    (block,) = python_blocks("## int8 attention")
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    expected = namespace["expected"]
    for name, bound in (("out", 0.05), ("out_tile", 0.02)):
        out = namespace[name]
        assert out.shape == expected.shape
        assert ((out - expected) ** 2).sum() ** 0.5 <= bound * (expected ** 2).sum() ** 0.5, name


def test_files_the_docs_name_exist():
    named = set(re.findall(r"`((?:docs|scripts|src|include|tests|examples|benchmarks|python)/[\w./-]+)`", README))
    for path in ROOT.glob("python/mfa_native/**/*.py"):
        named |= set(re.findall(r"\b(docs/[\w.-]+\.md)\b", path.read_text()))
    missing = sorted(p for p in named if not any(ROOT.glob(p.rstrip("/"))))
    assert missing == []
    assert "../shared" not in README


def test_reference_needs_no_import_of_its_own():
    code = "import mfa_native; print(mfa_native.reference.attention_reference.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "attention_reference"


def test_demo_tells_compiling_from_a_disk_cache_hit(tmp_path):
    env = dict(os.environ, MFA_NATIVE_CACHE_DIR=str(tmp_path), MFA_NATIVE_DEVICE="cpu")
    args = [sys.executable, "-m", "mfa_native", "demo", "--seq", "16", "--heads", "2", "--head-dim", "8"]
    cold = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    warm = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    assert "includes compiling 1 kernel" in cold
    assert "kernel loaded from the disk cache" in warm and "compiling" not in warm
