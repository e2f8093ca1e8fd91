"""Documentation a new user follows: every fenced python, sh and bash block of README.md and
docs/**/*.md (the site) runs as written in a fresh interpreter (issue "Reliability", items 6 and 9); the files
the README names exist in a clone; the documented `mfa_native.reference` works after a plain
`import mfa_native`; and the demo says what its first call spent time on.

A block that cannot run here carries a marker on the line before its fence:
`<!-- docs: skip: REASON -->` (the reason is the test's skip message) or
`<!-- docs: torchrun ARGS -->` (run with `torchrun --standalone ARGS`, e.g. two gloo ranks) or
`<!-- docs: mlx.launch ARGS -->` (run with `mlx.launch ARGS` on this interpreter, e.g. two ring
ranks on 127.0.0.1; a rank's non-zero exit fails the block even where mlx.launch exits 0).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
GUIDES = ROOT / "docs" / "guides"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = {"python", "sh", "bash"}            # the fence languages that are run
TIMEOUT_S = 180                           # per block (each takes seconds; a hang must not stall the suite)
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
# Never run (they change the machine: packages, the installed mfa_native), marked or not: a
# block doing any of this must carry a skip marker, and the runner refuses it otherwise.
INSTALLS = re.compile(r"\b(pip3? install|-m pip\b|apt-get|apt install|sudo|"
                      r"scripts/(run-tests|check-portable|compiler-sweep|wheel-smoke)\.sh)")
MARKER = re.compile(r"^\s*<!--\s*docs:\s*(?P<kind>skip|torchrun|mlx\.launch|exhaustive)\b:?\s*(?P<text>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int                  # of the opening fence, 1-based
    lang: str
    code: str
    # ("skip", reason), ("torchrun" or "mlx.launch", arguments), ("exhaustive", why): run in the
    # exhaustive step only (CI's second step), a block too long for the default run's budget
    marker: tuple[str, str] | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file (indented fences too, inside list items), with the
    docs marker of the line just before its fence."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, end = len(fence["indent"]), i + 1
        while not lines[end].strip().startswith("```"):
            end += 1
        code = "\n".join(line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1:end])
        marker = MARKER.match(lines[i - 1]) if i else None
        blocks.append(Block(path, i + 1, fence["lang"], code + "\n",
                            (marker["kind"], marker["text"]) if marker else None))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCS for block in fenced_blocks(path) if block.lang in RUN]
PARAMS = [pytest.param(block, id=block.where,
                       marks=[pytest.mark.exhaustive] if block.marker and block.marker[0] == "exhaustive" else [])
          for block in BLOCKS]


def _workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working directory that looks like a clone (every top-level entry of the repository
    linked in, so `examples/...` and `scripts/...` resolve, while whatever a block writes lands
    in tmp_path), and an environment whose `python` is this interpreter."""
    work, bin_dir = tmp_path / "clone", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (work / entry.name).symlink_to(entry)
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(sys.executable)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return work, env


def command(block: Block, script: Path) -> list[str]:
    """How a block runs: python in a fresh interpreter, shell with bash -e, torchrun blocks as
    their marker says."""
    if block.marker and block.marker[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *shlex.split(block.marker[1]),
                str(script)]
    if block.marker and block.marker[0] == "mlx.launch":
        return [str(Path(sys.executable).with_name("mlx.launch")), "--python", sys.executable,
                *shlex.split(block.marker[1]), str(script)]
    if block.lang == "python":
        return [sys.executable, "-c", block.code]
    return ["bash", "-e", "-o", "pipefail", "-c", block.code]


@pytest.mark.parametrize("block", PARAMS)
def test_the_block_runs_as_written(block: Block, tmp_path):
    if block.marker and block.marker[0] == "skip":
        assert block.marker[1], f"{block.where}: a skip marker needs its reason"
        pytest.skip(f"{block.where}: {block.marker[1]}")
    assert not INSTALLS.search(block.code), f"{block.where} installs something: mark it <!-- docs: skip: ... -->"
    assert block.marker is None or block.marker[0] == "exhaustive" or block.lang == "python", \
        f"{block.where}: {block.marker[0]} runs python blocks"
    work, env = _workspace(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    # A session of its own, so that a timeout ends the block's whole process tree (torchrun's
    # ranks, a shell's children), not only its first process.
    process = subprocess.Popen(command(block, script), cwd=work, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{block.where}: still running after {TIMEOUT_S} s\n{stdout[-4000:]}\n{stderr[-4000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    failed_rank = re.search(r"Node with rank \d+ exited with code [1-9-]", done.stdout + done.stderr)
    assert done.returncode == 0 and not failed_rank, (f"{block.where} ({block.lang}) exited with {done.returncode}\n"
                                  f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")


def test_markers_sit_on_run_blocks_and_skips_are_few():
    """A marker applies to the fence right after it (so none may stand elsewhere), and skipping
    stays the exception: each skip says why."""
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*<!--\s*docs:", line):   # a marker line (prose may quote the syntax)
                assert MARKER.match(line), f"{path.name}:{i + 1}: malformed docs marker {line!r}"
                fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                assert fence and fence["lang"] in RUN, f"{path.name}:{i + 1}: a docs marker must precede a run block"
    skipped = [b for b in BLOCKS if b.marker and b.marker[0] == "skip"]
    installing = [b.where for b in BLOCKS if INSTALLS.search(b.code) and b not in skipped]
    assert installing == [], "blocks that install must be skipped"
    assert all(b.marker[1] for b in skipped)
    assert len(skipped) <= len(BLOCKS) // 4, [b.where for b in skipped]


def python_blocks(page: str, section: str) -> list[str]:
    """The ```python blocks of the section titled `section` of docs/guides/`page` (up to the next
    heading of its level)."""
    text = (GUIDES / page).read_text()
    level = section.split()[0]
    start = text.index(section + "\n")
    end = text.find("\n" + level + " ", start + len(section))
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else None], re.S)


def test_the_attention_and_backward_snippets_run():
    namespace: dict = {}
    for block in python_blocks("attention.md", "# Attention")[:1] + python_blocks("backward.md", "# Backward pass")[:1]:
        exec(compile(block, "guides", "exec"), namespace)  # noqa: S102 - the guide's own code
    assert namespace["dq"].shape == namespace["q"].shape and namespace["dsinks"].shape == (8,)


def test_the_quantized_kv_snippet_runs():
    namespace: dict = {}
    (block,) = python_blocks("quantized.md", "## Quantized K/V caches")
    exec(compile(block, "quantized.md", "exec"), namespace)  # noqa: S102 - the guide's own code
    out, expected = (namespace[name].astype("float32") for name in ("out", "expected"))
    assert out.shape == (1, 32, 1, 128) and abs(out - expected).max() < 2e-3


def test_the_int8_attention_snippet_runs():
    namespace: dict = {}
    (block,) = python_blocks("quantized.md", "## int8 attention")
    exec(compile(block, "quantized.md", "exec"), namespace)  # noqa: S102 - the guide's own code
    expected = namespace["expected"]
    for name, bound in (("out", 0.05), ("out_tile", 0.02)):
        out = namespace[name]
        assert out.shape == expected.shape
        assert ((out - expected) ** 2).sum() ** 0.5 <= bound * (expected ** 2).sum() ** 0.5, name


def test_scripts_the_blocks_run_exist():
    """Skipped blocks too: `bash some/script.sh` in a block names a script of this repository."""
    scripts = {(b.where, path) for b in BLOCKS for path in re.findall(r"\bbash\s+([\w./-]+\.sh)\b", b.code)}
    assert scripts and sorted(s for s in scripts if not (ROOT / s[1]).is_file()) == []


def test_commands_the_docs_show_exist():
    """Every `bench NAME` and `emit KIND` the docs show is one, and the list under "Benchmarks"
    (docs/guides/performance.md) names every benchmark."""
    from mfa_native.cli import bench, emit

    text = "\n".join(path.read_text() for path in DOCS)
    assert set(re.findall(r"python -m mfa_native bench (\w+)", text)) <= set(bench.names())
    assert set(re.findall(r"python -m mfa_native emit (\w[\w-]*)", text)) <= set(emit.KINDS)
    performance = (GUIDES / "performance.md").read_text()
    section = performance[performance.index("## Benchmarks\n"):]
    listed = re.findall(r"^python -m mfa_native bench (\w+)", re.findall(r"```bash\n(.*?)```", section, re.S)[0], re.M)
    assert set(listed) == set(bench.names())


def test_files_the_docs_name_exist():
    named = set(re.findall(r"`((?:docs|scripts|src|include|tests|examples|benchmarks|python)/[\w./-]+)`",
                           "\n".join(path.read_text() for path in DOCS)))
    for path in ROOT.glob("python/mfa_native/**/*.py"):
        named |= set(re.findall(r"\b(docs/[\w.-]+\.md)\b", path.read_text()))
    missing = sorted(p for p in named if not any(ROOT.glob(p.rstrip("/"))))
    assert missing == []
    assert "../shared" not in README


@pytest.mark.parametrize("lang, block, source", [("cpp", 0, "examples/cpp/decode.cpp"),
                                                  ("cpp", 1, "examples/cpp/sparse.cpp"),
                                                  ("c", 0, "Attention from C: the C ABI")])
def test_the_readme_cpp_excerpt_is_lines_of_the_built_project(lang, block, source):
    """The README's C++ and C examples are lines of programs the tests build and run: the
    decode engine and the sparse example (ctest's decode_example and sparse_example, and
    tests/python/test_cpp_package.py against the installed package) and the C++ guide's C
    project (test_cpp_package.py): not sketches that could drift."""
    excerpt = re.findall(rf"```{lang}\n(.*?)```", README, re.S)[block].splitlines()
    if source.endswith(".cpp"):
        code = (ROOT / source).read_text()
    else:
        guide = (GUIDES / "cpp.md").read_text().split(f"## {source}\n", 1)[1].split("\n## ", 1)[0]
        code = re.search(rf"```{lang}\n(.*?)```", guide, re.S)[1]
    built = {line.strip() for line in code.splitlines()}
    assert excerpt and [line for line in excerpt if line.strip() not in built] == []


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


def test_profile_byte_counts_are_accesses_as_documented():
    """docs/guides/custom-kernels.md, "Profiling": k of 4 KiB shows as 128 KiB read (every simdgroup of every query
    head reads all of it); the README and profile()'s docstrings say they count accesses."""
    import numpy as np

    import mfa_native
    from mfa_native.runtime import profiling

    q = np.random.randn(1, 4, 64, 32).astype(np.float16)
    k = np.random.randn(1, 1, 64, 32).astype(np.float16)
    v = np.random.randn(1, 1, 64, 32).astype(np.float16)
    with mfa_native.profile() as p:
        mfa_native.attention(q, k, v, device="cpu")
    (record,) = p.records
    assert record.bytes_read["k"] == 32 * k.nbytes == 128 * 1024 and p.bytes_read == record.bytes_read
    assert record.bytes_written == {"q": 0, "k": 0, "v": 0, "o": q.nbytes}
    kernels = (GUIDES / "custom-kernels.md").read_text()
    section = kernels[kernels.index("## Profiling"):]
    assert "accesses, not distinct bytes" in section and "128 KiB" in section
    for documented in (profiling.DispatchRecord, profiling.DispatchRecord.bytes_read,
                       profiling.DispatchRecord.bytes_written, profiling.Profile.bytes_read,
                       profiling.Profile.bytes_written):
        assert "not distinct bytes" in " ".join(documented.__doc__.split()), documented
