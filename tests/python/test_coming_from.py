"""The "Coming from ..." pages (docs/coming-from/*.md) against the libraries they map: each
page's table for a peer's entry point lists exactly that entry point's parameters (read from
the installed library where it is installed here: torch, MLX, mlx-lm; else from the
signatures recorded below or in test_flash_attn_dense.py), and every `mfa_native...` name a
page cites exists, with the arguments it names, so that a renamed function or argument
fails here. Fast: signatures only, no kernel runs (the pages' examples run in test_docs.py).

A table belongs to the nearest heading above it; the heading names its entry points in
backticks (one or more), and the table's first column holds the peer's parameter names in
backticks. "refused" in a row's notes comes with the error a call raises."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "coming-from"
PAGE_NAMES = ("flash-attn", "flexattention", "mlx", "llama-cpp", "flashmla")
MAX_LINES = 150

# flash-attn v2.8.3 (Dao-AILab/flash-attention, tag v2.8.3 = 060c9188beec3a8b62b33a3bfa6d5d2d44975fab,
# flash_attn/flash_attn_interface.py): the two public functions test_flash_attn_dense.py does not
# record.
FLASH_ATTN_MORE = {
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale causal "
                              "window_size softcap alibi_slopes deterministic return_attn_probs block_table",
    "flash_attn_with_kvcache": "q k_cache v_cache k v rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad "
                               "block_table softmax_scale causal window_size softcap rotary_interleaved alibi_slopes "
                               "num_splits return_softmax_lse",
}

# FlashMLA (deepseek-ai/FlashMLA 9241ae3ef9bac614dd25e45e507e089f888280e0, flash_mla/flash_mla_interface.py).
# get_mla_metadata takes (*args, **kwargs) there "to be compatible with the old interface" and ignores
# them; the old interface's parameters are those of c28eca9 (same file).
FLASHMLA = {
    "get_mla_metadata": "cache_seqlens num_q_tokens_per_head_k num_heads_k num_heads_q is_fp8_kvcache topk",
    "flash_mla_with_kvcache": "q k_cache block_table cache_seqlens head_dim_v tile_scheduler_metadata num_splits "
                              "softmax_scale causal is_fp8_kvcache indices attn_sink extra_k_cache "
                              "extra_indices_in_kvcache topk_length extra_topk_length",
    "flash_mla_sparse_fwd": "q kv indices sm_scale d_v attn_sink topk_length",
    "flash_attn_varlen_func": "q k v cu_seqlens_qo cu_seqlens_kv max_seqlen_qo max_seqlen_kv dropout_p softmax_scale "
                              "causal deterministic is_varlen",
}

# llama.cpp (ggml-org/llama.cpp 004eaba804a34aa1a397b61d6d5274171c5e4cba, ggml/include/ggml.h), and the
# cache types -ctk / -ctv accept (common/arg.cpp, kv_cache_types, as ggml_type_name spells them).
LLAMA_CPP = {
    "ggml_flash_attn_ext": "ctx q k v mask scale max_bias logit_softcap",
    "ggml_flash_attn_ext_add_sinks": "a sinks",
    "ggml_flash_attn_ext_set_prec": "a prec",
    "--cache-type-k": "f32 f16 bf16 q8_0 q4_0 q4_1 iq4_nl q5_0 q5_1",
}

FENCED = re.compile(r"^```.*?^```", re.M | re.S)
TICKED = re.compile(r"`([^`]+)`")
CITED = re.compile(r"`(mfa_native(?:\.\w+)+)(\([^`]*\))?`")
ERROR = re.compile(r"\b[A-Z]\w*Error\b")


def page_text(name: str) -> str:
    return (PAGES / f"{name}.md").read_text()


def _cells(line: str) -> list[str]:
    """A table row's cells, split on the pipes outside backticks."""
    cells, cell, ticked = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            ticked = not ticked
        if ch == "|" and not ticked:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return cells + [cell.strip()]


def tables(name: str) -> list[tuple[str, list[list[str]]]]:
    """(heading, body rows) of every table of a page, the heading being the nearest above it."""
    found, heading, rows = [], "", None
    for line in FENCED.sub("", page_text(name)).splitlines():
        if line.startswith("|"):
            if rows is None:
                rows = []
                found.append((heading, rows))
            rows.append(_cells(line))
            continue
        rows = None
        if line.startswith("#"):
            heading = line
    return [(h, body[2:]) for h, body in found]   # without the header and separator rows


def table_of(page: str, entry: str) -> list[list[str]]:
    """The body rows of the table under the heading that names `entry` in backticks."""
    matches = [rows for heading, rows in tables(page) if entry in TICKED.findall(heading)]
    assert len(matches) == 1, f"{page}.md: {len(matches)} tables under a heading naming `{entry}`"
    return matches[0]


def listed(rows: list[list[str]]) -> list[str]:
    """The peer's names a table lists: the backticked names of its first column."""
    return [name for row in rows for name in TICKED.findall(row[0])]


def assert_maps(page: str, entry: str, parameters, others=()) -> None:
    """The table under the heading naming `entry` lists each of its parameters once, and
    nothing else (`others`: what the heading's other entry points add)."""
    names = listed(table_of(page, entry))
    assert len(names) == len(set(names)), f"{page}.md, `{entry}`: a parameter listed twice"
    assert sorted(set(parameters) - set(names)) == [], f"{page}.md, `{entry}`: missing parameters"
    assert sorted(set(names) - set(parameters) - set(others)) == [], f"{page}.md, `{entry}`: not its parameters"


def _top_level(text: str) -> list[str]:
    """`text` split on the commas outside brackets."""
    parts, depth, part = [], 0, ""
    for ch in text:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    return [p.strip() for p in parts + [part] if p.strip()]


def parameters_of(function) -> list[str]:
    """A function's parameter names: inspect.signature, or for a builtin (torch's SDPA, nanobind
    functions of MLX) the signature its docstring starts with (names before ':' or '=';
    '*' and '/' dropped)."""
    try:
        return [p for p in inspect.signature(function).parameters if p not in ("args", "kwargs")]
    except (TypeError, ValueError):
        pass
    text = getattr(function, "__text_signature__", None) or function.__doc__
    opened = text.index("(")
    depth = 0
    for end in range(opened, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    names = [re.match(r"\*{0,2}(\w*)", p)[1] for p in _top_level(text[opened + 1:end])]
    return [n for n in names if n and n not in ("self", "args", "kwargs")]


def words(text: str) -> list[str]:
    return text.split()


def recorded_flash_attn() -> dict[str, list[str]]:
    """test_flash_attn_dense.py's FLASH_ATTN (flash-attn 2.8's signatures), read without
    importing it (it imports torch): each function's parameter names."""
    tree = ast.parse((Path(__file__).parent / "test_flash_attn_dense.py").read_text())
    recorded = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "FLASH_ATTN" for t in node.targets)]
    assert len(recorded) == 1, "test_flash_attn_dense.py no longer records FLASH_ATTN"
    return {name: re.findall(r"(?:^|\s)([A-Za-z_]\w*)(?==|\s|$)", text) for name, text in recorded[0].items()}


def by_heading(page: str, signatures: dict[str, list[str]]) -> None:
    """Every entry point's table lists its parameters; a heading naming several lists their union."""
    for entry, parameters in signatures.items():
        heading = [h for h, _ in tables(page) if entry in TICKED.findall(h)]
        siblings = {n for h in heading for n in TICKED.findall(h) if n in signatures}
        assert_maps(page, entry, parameters, {p for n in siblings for p in signatures[n]})


def test_flash_attn_page_maps_every_recorded_parameter():
    signatures = {**recorded_flash_attn(), **{n: words(s) for n, s in FLASH_ATTN_MORE.items()}}
    assert {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"} <= set(signatures)
    by_heading("flash-attn", signatures)


def test_flexattention_page_maps_torchs_signatures():
    pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.nn.attention import flex_attention

    by_heading("flexattention", {
        "flex_attention": parameters_of(flex_attention.flex_attention),
        "create_block_mask": parameters_of(flex_attention.create_block_mask),
        "scaled_dot_product_attention": parameters_of(F.scaled_dot_product_attention),
    })


def _mlx_lm_quantized_sdpa() -> list[str]:
    """mlx-lm's quantized_scaled_dot_product_attention's parameters, read from its source (importing
    mlx_lm imports transformers: seconds)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mlx-lm is not installed")
    source = Path(spec.submodule_search_locations[0], "models", "base.py").read_text()
    (function,) = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)
                   and node.name == "quantized_scaled_dot_product_attention"]
    arguments = function.args
    return [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]


def test_mlx_page_maps_mlx_and_mlx_lm_signatures():
    mx = pytest.importorskip("mlx.core")
    signatures = {"mx.fast.scaled_dot_product_attention": parameters_of(mx.fast.scaled_dot_product_attention),
                  "quantized_scaled_dot_product_attention": _mlx_lm_quantized_sdpa(),
                  "mx.quantize": parameters_of(mx.quantize)}
    assert {"q", "k", "v", "scale", "mask"} <= set(signatures["mx.fast.scaled_dot_product_attention"])
    assert "quantized_scaled_dot_product_attention" not in dir(mx.fast), \
        "MLX has a quantized SDPA in mx.fast now: map it on the MLX page"
    by_heading("mlx", signatures)


def test_llama_cpp_page_maps_ggml_and_the_cache_types():
    by_heading("llama-cpp", {n: words(s) for n, s in LLAMA_CPP.items()})


def test_flashmla_page_maps_its_interface():
    by_heading("flashmla", {n: words(s) for n, s in FLASHMLA.items()})


def resolve(dotted: str):
    """The object a dotted `mfa_native...` name names: the longest importable module, then
    attributes. Skips when a framework the module imports (torch, mlx) is not installed."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and not module_name.startswith(error.name):
                pytest.skip(f"{module_name} needs {error.name}")
            continue
        break
    for attribute in parts[end:]:
        assert hasattr(target, attribute), f"{dotted}: {'.'.join(parts[:end])} has no {attribute}"
        target = getattr(target, attribute)
    return target


def cited(page: str) -> list[tuple[str, list[str]]]:
    """Each `mfa_native...` name the page cites outside code blocks, with the argument names
    its parentheses hold (`f(a, b=...)` names a and b; a literal value names nothing)."""
    found = []
    for name, call in CITED.findall(FENCED.sub("", page_text(page))):
        arguments = _top_level(call[1:-1]) if call else []
        found.append((name, [m[1] for a in arguments if (m := re.match(r"(\w+)\s*(?:=|$)", a))]))
    return found


@pytest.mark.parametrize("page", PAGE_NAMES)
def test_every_cited_mfa_native_name_exists_with_its_arguments(page):
    names = cited(page)
    assert names, f"{page}.md cites no mfa_native name"
    for name, arguments in sorted(set((n, tuple(a)) for n, a in names)):
        target = resolve(name)
        if arguments:
            assert set(arguments) <= set(inspect.signature(target).parameters), \
                f"{page}.md: {name} has no parameter {sorted(set(arguments) - set(inspect.signature(target).parameters))}"


@pytest.mark.parametrize("page", PAGE_NAMES)
def test_page_shape(page):
    """Short; three-column tables whose every row names what to call (or — for nothing) and says
    which error a refused argument raises; a "What we refuse" section; one runnable example."""
    text = page_text(page)
    assert len(text.splitlines()) < MAX_LINES
    assert "\n## What we refuse\n" in text
    assert len(re.findall(r"^```python$", text, re.M)) == 1
    assert tables(page)
    for heading, rows in tables(page):
        for row in rows:
            assert len(row) == 3, (page, heading, row)
            assert row[1] == "—" or CITED.search(row[1]), (page, heading, row)
            assert not row[2].startswith("refused") or ERROR.search(row[2]), (page, heading, row)
