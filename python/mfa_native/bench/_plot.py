"""`bench attention --plot FILE.png`: MFA-style charts against head dimension, one column per
direction (forward, backward), one line per precision. On Metal: throughput (useful TFLOPS
from GPU timestamps). On the cpu backend, whose times are not a GPU's: the simdgroup_matrix
operations issued per useful one, and device bytes per useful multiply-accumulate (the
traffic counters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import profile

DTYPES = ("float32", "float16", "bfloat16")
# Each precision's look: marker, line style, marker size (not colour alone, and a series lying on
# another stays visible: hollow markers of different sizes, drawn larger first).
STYLES = {"float32": ("o", "-", 9), "float16": ("s", "--", 7), "bfloat16": ("^", ":", 5)}
DIRECTIONS = ("forward", "backward")
HEAD_DIMS = (32, 64, 96, 128, 192, 256, 384, 576)


@dataclass(frozen=True)
class Point:
    """One measured call: seconds (best of the repeats), ops issued, device bytes."""

    seconds: float
    issued: int | None
    device_bytes: int


def measure(call: Callable[[], object], repeat: int) -> Point:
    """Warm `call`, then run it `repeat` times inside profile(); the best time and the counts."""
    call()
    best = None
    for _ in range(repeat):
        with profile() as profiled:
            call()
        counted = [r.simdgroup_matrix_ops for r in profiled.records]
        point = Point(profiled.seconds, None if None in counted else sum(counted),
                      sum(profiled.bytes_read.values()) + sum(profiled.bytes_written.values()))
        best = point if best is None or point.seconds < best.seconds else best
    return best


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("bench attention --plot draws with matplotlib, which is not installed "
                                  "(pip install matplotlib, or the project's test extra)") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def draw(path: str, title: str, points: dict[tuple[str, str, int], tuple[Point, int, int]], on_metal: bool) -> None:
    """points[(direction, dtype, D)] = (measured point, useful multiply-accumulates (flops are 2
    per), useful simdgroup_matrix ops (work.py)). Writes the PNG at `path`."""
    pyplot = _pyplot()
    figure = charts(pyplot, title, points, on_metal)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def charts(pyplot, title: str, points: dict[tuple[str, str, int], tuple[Point, int, int]], on_metal: bool):
    """The figure `draw` saves: per direction and metric an axes, per precision a series styled
    by STYLES, units on both axes."""
    metrics = ([("useful throughput", "TFLOPS (useful flops per second / 1e12)",
                 lambda p, macs, ops: 2 * macs / p.seconds / 1e12)] if on_metal else
               [("issued / useful simdgroup_matrix ops", "ratio (8x8x8 ops issued per useful op)",
                 lambda p, macs, ops: (p.issued or 0) / ops),
                ("device traffic", "bytes per useful multiply-accumulate",
                 lambda p, macs, ops: p.device_bytes / macs)])
    figure, axes = pyplot.subplots(len(metrics), len(DIRECTIONS), figsize=(6 * len(DIRECTIONS), 3.8 * len(metrics)),
                                   squeeze=False)
    for column, direction in enumerate(DIRECTIONS):
        for row, (label, unit, value) in enumerate(metrics):
            ax = axes[row][column]
            for dtype in DTYPES:
                dims = sorted(d for (dn, dt, d) in points if dn == direction and dt == dtype)
                if dims:
                    marker, line, size = STYLES[dtype]
                    ax.plot(dims, [value(*points[(direction, dtype, d)]) for d in dims], marker=marker, linestyle=line,
                            markersize=size, markerfacecolor="none", markeredgewidth=1.5, label=dtype)
            ax.set_title(f"{direction}: {label}")
            ax.set_xlabel("head dimension D = Dv (elements)")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
            ax.legend()
    figure.suptitle(title)
    figure.tight_layout()
    return figure
