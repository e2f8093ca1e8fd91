"""The context-parallel schedule (no processes, no kernels): each (query block, key shard) call
allows exactly the global band's keys, and the zig-zag assignment gives every rank the same work."""

from __future__ import annotations

import numpy as np
import pytest

from mfa_native.context.schedule import Span, allowed, band, blocks, pair, spans
from mfa_native.reference import allowed_keys


def test_each_pair_of_shards_is_the_global_band(rng):
    """The (rows, keys, window) call of every pair of shards allows exactly the keys that causal
    and window allow on the concatenated sequences (single process, no kernels)."""
    for _ in range(300):
        size = int(rng.integers(1, 5))
        q_lens, kv_lens = rng.integers(0, 7, size), rng.integers(0, 7, size)
        R, C = int(q_lens.sum()), int(kv_lens.sum())
        causal = [False, "lower_right", "upper_left"][rng.integers(3)]
        window = None if rng.random() < 0.3 else tuple(int(side) for side in rng.integers(-1, 6, 2))
        allowed = allowed_keys(R, C, causal, window)
        rule = band({False: "none"}.get(causal, causal), window, R, C)
        q_offsets, kv_offsets = np.cumsum([0, *q_lens]), np.cumsum([0, *kv_lens])
        for r in range(size):
            for s in range(size):
                want = allowed[q_offsets[r]:q_offsets[r + 1], kv_offsets[s]:kv_offsets[s + 1]]
                call = pair(rule, Span(int(q_offsets[r]), int(q_lens[r])), Span(int(kv_offsets[s]), int(kv_lens[s])))
                got = np.zeros_like(want)
                if call is not None:
                    got[:call.rows, :call.keys] = allowed_keys(call.rows, call.keys, False, call.window)
                assert (got == want).all() and (call is None or got.any()), (q_lens, kv_lens, causal, window, r, s)


@pytest.mark.parametrize("causal", ["lower_right", "upper_left"])
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("lengths", ["even", "uneven"])
def test_causal_work_is_balanced_whatever_the_shards(causal, size, lengths):
    """Every rank's (query, key) pairs within 10 % of the mean for a 16k-token causal prefill, the
    ranks' own shards even or not (one holds nothing); without the zig-zag the last rank does
    about 2N/(N+1) times the mean."""
    total = 16384
    if lengths == "even":
        q_lens = [total // size] * size
    else:
        q_lens = [0, *np.diff(np.sort(np.random.default_rng(size).integers(0, total, size - 2))).tolist()]
        q_lens += [total - sum(q_lens) - 1, 1]
    shards = spans(q_lens)
    rule = band(causal, None, total, total)
    work = [sum(allowed(rule, block, key) for block in mine for key in shards) for mine in blocks(causal, shards)]
    assert sum(work) == total * (total + 1) // 2
    assert max(work) <= 1.1 * np.mean(work) and min(work) >= 0.9 * np.mean(work), work
    own = [allowed(rule, shard, Span(0, total)) for shard in shards]
    assert lengths == "uneven" or max(own) > 1.3 * np.mean(own)


def test_allowed_counts_the_band(rng):
    for _ in range(200):
        R, C = (int(x) for x in rng.integers(0, 12, 2))
        causal = ["none", "lower_right", "upper_left"][rng.integers(3)]
        window = None if rng.random() < 0.3 else tuple(int(side) for side in rng.integers(-1, 6, 2))
        q0, k0 = (int(x) for x in rng.integers(0, 5, 2))
        rule = band(causal, window, R + q0 + 3, C + k0 + 2)
        keys = allowed_keys(R + q0 + 3, C + k0 + 2, {"none": False}.get(causal, causal), window)
        assert allowed(rule, Span(q0, R), Span(k0, C)) == keys[q0:q0 + R, k0:k0 + C].sum()


@pytest.mark.exhaustive   # 12 s cold: the bench runs both schedules on two ranks
def test_bench_ring_reports_bytes_and_overlap():
    """`bench ring --quick` on 2 gloo processes: the prefill's ring moves K/V (and the zig-zag
    queries) with balanced work; the decode sends nothing around the ring and all-gathers a few
    hundred bytes, not the 8k-token cache."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mfa_native", "bench", "ring", "--quick", "--ranks", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in done.stdout.splitlines()[2:]}
    prefill, decode = rows["prefill"], rows["decode"]
    assert int(prefill[4].replace(",", "")) >= 2 * 512 * 64 * 4 and prefill[-1] == "1.00"
    assert prefill[9].endswith("%") and decode[9] == "-"
    assert decode[4] == "0" and 0 < int(decode[5].replace(",", "")) < 2000
