"""int8 attention against float64 attention on the original inputs:
`python -m mfa_native bench int8_accuracy [--length 1024] [--head-dim 128] [--heads 2] [--device cpu]`.

The metrics SageAttention and MFA 2.0 report: cosine similarity, relative L1
(sum |out - ref| / sum |ref|), RMSE and relative L2 (||out - ref|| / ||ref||), for two
kinds of inputs (standard normal q, k, v; and the same with K biased per channel by 10
sigma, one channel by 100 sigma, the case smooth_k exists for) and every combination of
qk_scale, smooth_k and pv, causal=False.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..ops.int8_attention import int8_attention
from ..reference import attention_reference
from ..runtime.devices import resolve_device
from . import _table
from ._table import Table

BIAS_SIGMAS = 10.0          # every channel of K is shifted by this many standard deviations
OUTLIER_FACTOR = 10.0       # ... and one channel by this factor more


def gaussian(rng: np.random.Generator, shapes) -> tuple[np.ndarray, ...]:
    """Standard-normal float32 q, k, v of `shapes` (bhsd)."""
    return tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)


def biased_keys(rng: np.random.Generator, shapes) -> tuple[np.ndarray, ...]:
    """`gaussian`, with K + a per-channel bias of +-BIAS_SIGMAS (random signs), one channel's
    OUTLIER_FACTOR times larger (the same bias for every batch, head and key)."""
    q, k, v = gaussian(rng, shapes)
    head_dim = k.shape[-1]
    bias = BIAS_SIGMAS * rng.choice([-1.0, 1.0], size=head_dim)
    bias[rng.integers(head_dim)] *= OUTLIER_FACTOR
    return q, (k + bias.astype(np.float32)).astype(np.float32), v


INPUTS = {"gaussian": gaussian, "biased K": biased_keys}


def metrics(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """CosSim, relative L1, RMSE and relative L2 of `out` against `ref` (float64)."""
    a = np.asarray(out, dtype=np.float64).ravel()
    b = np.asarray(ref, dtype=np.float64).ravel()
    diff = a - b
    return {"CosSim": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))),
            "relative L1": float(np.abs(diff).sum() / np.abs(b).sum()),
            "RMSE": float(np.sqrt(np.mean(diff * diff))),
            "relative L2": float(np.linalg.norm(diff) / np.linalg.norm(b))}


def main(argv: list[str]) -> int:
    parser = _table.parser("int8_accuracy", __doc__)
    parser.add_argument("--length", type=int, default=1024, help="R = C")
    parser.add_argument("--head-dim", type=int, default=128, help="D = Dv")
    parser.add_argument("--heads", type=int, default=2, help="Hq = Hkv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or metal (default: the default device)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    shape = (1, args.heads, args.length, args.head_dim)
    variants = list(itertools.product(("int8", "float"), ("token", "tile"), (True, False)))

    def rows():
        rng = np.random.default_rng(args.seed)
        for name, make in INPUTS.items():
            q, k, v = make(rng, (shape, shape, shape))
            ref = attention_reference(q, k, v)
            for pv, qk_scale, smooth_k in variants:
                out = int8_attention(q, k, v, qk_scale=qk_scale, smooth_k=smooth_k, pv=pv, device=device)
                m = metrics(out, ref)
                yield [name, pv, qk_scale, "yes" if smooth_k else "no", f"{m['CosSim']:.6f}",
                       f"{m['relative L1']:.4f}", f"{m['RMSE']:.2e}", f"{m['relative L2']:.4f}"]
    title = (f"int8_attention vs float64 attention, R = C = {args.length}, D = {args.head_dim}, {args.heads} heads, "
             f"float32 inputs, device {device.name}")
    widths = [max(map(len, INPUTS)), len("float"), 0, 0, len("0.999999"), 0, len("1.00e-03")]
    _table.show("int8_accuracy", [Table(["inputs", "pv", "qk_scale", "smooth_k", "CosSim", "rel L1", "RMSE", "rel L2"],
                                        rows(), len(INPUTS) * len(variants), title, widths)], quiet=args.quiet)
    return 0
