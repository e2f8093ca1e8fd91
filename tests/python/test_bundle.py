"""Bundles (mfa_native.bundle, `python -m mfa_native bundle`): the file format, the spec, and
that an entry's templates are exactly what codegen generates for every call they serve."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import asdict

import pytest

from mfa_native import codegen
from mfa_native.bundle import BundleError, entries_of
from mfa_native.bundle.file import FORMAT_VERSION, HEADER_BYTES, pack, unpack
from mfa_native.bundle.writer import backward_templates, choose, forward_templates, problem

SMALL = {"op": "attention", "dtype": ["float32"], "head_dim": [16], "causal": ["lower_right"], "mask": ["none"],
         "window": [False], "sinks": [True], "layout": ["bhsd"], "family": ["apple9"],
         "backward": True}


def test_format_round_trip_and_refusals():
    payload = {"entries": [], "x": [1, 2.5, "é"]}
    data = pack(payload)
    assert unpack(data) == payload
    with pytest.raises(BundleError, match="shorter than"):
        unpack(data[:10])
    with pytest.raises(BundleError, match="truncated"):
        unpack(data[:-1])
    damaged = bytearray(data)
    damaged[-2] ^= 1
    with pytest.raises(BundleError, match="sha256"):
        unpack(bytes(damaged))
    with pytest.raises(BundleError, match="magic"):
        unpack(b"X" + data[1:])
    future = data[:8] + struct.pack("<I", FORMAT_VERSION + 1) + data[12:]
    with pytest.raises(BundleError, match="newer"):
        unpack(future)
    for version in (1, 2, 3):   # format 1 baked windows and strides; 2 had no score transforms; 3 no declarations
        earlier = data[:8] + struct.pack("<I", version) + data[12:]
        with pytest.raises(BundleError, match="write the bundle again"):
            unpack(earlier)
    assert len(data) == HEADER_BYTES + len(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())


def test_spec_crosses_lists_and_fills_omitted_keys():
    entries = entries_of({"families": [{"op": "attention", "head_dim": [64], "dtype": ["float16"],
                                        "family": ["apple9"]}]})
    # causal 3 x mask (none, bool, additive x 3 dtypes) x window 2 x sinks 2 x layout 2
    assert len(entries) == 3 * 5 * 2 * 2 * 2
    assert {e.value_dim for e in entries} == {64} and {e.window for e in entries} == {False, True}
    assert {e.mask_dtype for e in entries if e.mask == "additive"} == {"float32", "float16", "bfloat16"}
    assert len(entries_of({"families": [{"op": "attention", "head_dim": [64], "dtype": ["float16"]}]})) == \
        4 * len(entries)   # every GPU family


@pytest.mark.parametrize("family, message", [
    ({"op": "attention"}, "head_dim' is required"),
    ({"op": "sparse", "head_dim": [8]}, "'op' must be"),
    ({"op": "attention", "head_dim": [8], "window": [[128, 0]]}, "'window' values must be true or false"),
    ({"op": "attention", "head_dim": [600]}, "1..576"),
    ({"op": "attention", "head_dim": [8], "colour": ["red"]}, "unknown keys"),
    ({"op": "attention", "head_dim": [8], "scale": [0.3]}, "'scale' is not a key: every entry takes the scale"),
    ({"op": "attention", "head_dim": [8], "causal": ["sideways"]}, "not one of"),
    ({"op": "attention", "head_dim": [8], "page_size": [16]}, "unknown keys"),
    ({"op": "attention_with_kvcache", "head_dim": [64], "mask": ["bool"]}, "unknown keys"),
    ({"op": "attention_with_kvcache", "head_dim": [64], "page_size": [0]}, "'page_size' values must be null"),
    ({"op": "attention_with_kvcache", "head_dim": [64], "cache": ["q3_k"]}, "'cache' value 'q3_k' is not one of"),
    ({"op": "attention_with_kvcache", "head_dim": [64], "cache": [["plain"]]}, "or a \\[k_cache's, v_cache's\\] pair"),
    ({"op": "attention_with_kvcache", "head_dim": [48], "cache": ["q8_0"]}, "must be a multiple of 32, got 48"),
    ({"op": "attention_with_kvcache", "head_dim": [64], "cache": ["affine"], "group_size": [128]},
     "head_dim must be a multiple of 128, got 64"),
    ({"op": "attention_with_kvcache", "head_dim": [64], "cache": ["q8_0"], "bits": [4]}, "'bits' is an affine cache's"),
    ({"op": "int8_attention", "head_dim": [264]}, "int8_attention's head dimensions are 1..256, got 264"),
    ({"op": "int8_attention", "head_dim": [64], "score_mod": [None]}, "unknown keys"),
    ({"op": "int8_attention", "head_dim": [64], "qk_scale": ["row"]}, "'qk_scale' value 'row' is not one of"),
    ({"op": "int8_attention", "head_dim": [64], "smooth_k": ["yes"]}, "'smooth_k' values must be true or false"),
    ({"op": "int8_attention", "head_dim": [64], "pv": ["int4"]}, "'pv' value 'int4' is not one of"),
    ({"op": "merge_attention", "value_dim": [64]}, "'parts' is required"),
    ({"op": "merge_attention", "parts": [2]}, "'value_dim' is required"),
    ({"op": "merge_attention", "value_dim": [64], "parts": [0]}, "'parts' values must be integers >= 1"),
    ({"op": "merge_attention", "value_dim": [64], "parts": [2], "head_dim": [64]}, "unknown keys"),
    ({"op": "quantize", "format": ["q3_k"]}, "'format' value 'q3_k' is not one of"),
    ({"op": "quantize", "bits": [7]}, "'bits' value 7 is not one of"),
    ({"op": "quantize", "group_size": [16]}, "'group_size' value 16 is not one of"),
    ({"op": "quantize", "head_dim": [64]}, "unknown keys"),
])
def test_spec_errors_name_the_key(family, message):
    with pytest.raises(ValueError, match=message):
        entries_of({"families": [family]})


def test_a_kvcache_family_crosses_its_cache_keys():
    entries = entries_of({"families": [{"op": "attention_with_kvcache", "head_dim": [64], "dtype": ["float16"],
                                        "family": ["apple9"], "causal": ["lower_right"], "window": [False],
                                        "sinks": [False], "page_size": [None, 16]}]})
    # page_size 2 x cache (plain, GGUF's 5, affine's 6 bits x 2 group sizes dividing 64, float8's 2)
    # x append 2; layout bshd, no mask, forward only
    assert len(entries) == 2 * (6 + 6 * 2 + 2) * 2
    assert {(e.layout, e.mask, e.backward, e.op) for e in entries} == {("bshd", "none", False,
                                                                         "attention_with_kvcache")}


KVCACHE = {"op": "attention_with_kvcache", "dtype": ["float32"], "head_dim": [64], "gqa_ratio": [2],
           "causal": ["lower_right"], "window": [False], "sinks": [False], "family": ["apple9"]}


def assert_chosen_are_codegens(facts, p, forward: list, backward: list, where,
                               parallel_threadgroups: int | None = None) -> None:
    """The templates an entry's `forward` (and `backward`, if any) choose for the sizes of
    problem `p` are the ones codegen generates for it; `where` names the case."""
    sizes = codegen.call_sizes(p, parallel_threadgroups)
    expected = codegen.attention_template(p, family=facts.family, parallel_threadgroups=parallel_threadgroups)
    assert choose(forward, sizes) == json.loads(json.dumps(asdict(expected))), where
    if backward:
        expected = codegen.attention_backward_template(codegen.AttentionBackwardProblem(p), family=facts.family)
        assert choose(backward, sizes) == json.loads(json.dumps(asdict(expected))), where


@pytest.mark.parametrize("facts", entries_of({"families": [
    SMALL, {**SMALL, "causal": ["none"], "sinks": [False], "mask": ["additive"], "mask_dtype": ["float16"],
            "window": [True], "gqa_ratio": [2], "layout": ["bshd"], "dtype": ["float16"]},
    {**KVCACHE, "page_size": [16], "cache": ["q8_0"], "append": [True]},
    {**KVCACHE, "page_size": [None], "cache": ["plain"], "append": [False]},
    {**KVCACHE, "page_size": [16], "cache": ["affine"], "bits": [3], "group_size": [32], "append": [True]},
    {**KVCACHE, "page_size": [None], "cache": [["float8_e4m3fn", "float8_e5m2"]], "append": [True]}]}))
def test_entry_templates_are_codegens_for_every_length(facts):
    """For lengths across every tile choice (and decode shapes that split), the entry's first
    template whose guards hold is the template codegen generates for that call."""
    forward, backward = forward_templates(facts), backward_templates(facts) if facts.backward else []
    for r in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 300):   # packing: R * ratio <= 128
        for c, p in ((1, 4), (5, 4), (64, 4), (700, 4), (4096, 1024), (20000, 1 << 16)):
            if c == 1 and "float8" in facts.cache:   # codegen at one key spells a descale's batch stride C * Hkv
                continue                            # (its broadcast key axis has extent 1), the entry's Hkv
            assert_chosen_are_codegens(facts, problem(facts, r, c, batch=2, kv_heads=2), forward,
                                       backward if c < 1000 else [], (r, c, p), parallel_threadgroups=p)


def test_cli_writes_and_lists(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"families": [SMALL]}))
    out = tmp_path / "b.mfab"
    run = [sys.executable, "-m", "mfa_native", "bundle"]
    subprocess.run(run + ["-o", str(out), "--spec", str(spec), "--quiet"], check=True)
    listed = subprocess.run(run + ["--list", str(out)], check=True, capture_output=True, text=True).stdout
    assert listed.splitlines() == ["attention float32 D=16 Dv=16 gqa=1 causal=lower_right mask=none window=no "
                                   "sinks=yes layout=bhsd family=apple9 templates=4+4"]
    out.write_bytes(out.read_bytes()[:-5])
    failed = subprocess.run(run + ["--list", str(out)], capture_output=True, text=True)
    assert failed.returncode == 1 and "truncated" in failed.stderr
    if sys.platform != "darwin":
        failed = subprocess.run(run + ["-o", str(out), "--spec", str(spec), "--metallib"], capture_output=True,
                                text=True)
        assert failed.returncode == 1 and "metal device" in failed.stderr
