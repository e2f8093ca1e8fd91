"""`bench attention --plot`: a PNG of the charts with matplotlib, a clear error naming it without."""

from __future__ import annotations

import sys

import pytest

from mfa_native.__main__ import main
from mfa_native.bench import _plot


def test_the_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "attention.png"
    assert main(["bench", "attention", "--plot", str(path), "--repeat", "1", "--head-dims", "8", "24"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert f"wrote {path}" in capsys.readouterr().out


def test_without_matplotlib_the_error_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        _plot.draw(str(tmp_path / "x.png"), "title", {}, on_metal=False)
    assert not (tmp_path / "x.png").exists()


def test_every_series_is_told_apart_without_colour_and_the_axes_carry_units():
    """Each precision has its own marker and line style (hollow markers of decreasing size, so a
    series on top of another shows both), and every axis names its unit."""
    pytest.importorskip("matplotlib")
    pyplot = _plot._pyplot()
    point = _plot.Point(1e-3, 100, 4096)
    points = {(direction, dtype, d): (point, 1000 * d, 50) for direction in _plot.DIRECTIONS
              for dtype in _plot.DTYPES for d in (32, 64)}
    for on_metal in (False, True):
        figure = _plot.charts(pyplot, "t", points, on_metal)
        for ax in figure.axes:
            looks = {(line.get_marker(), line.get_linestyle(), line.get_markersize()) for line in ax.get_lines()}
            assert len(looks) == len(ax.get_lines()) == len(_plot.DTYPES)
            assert len({m for m, _, _ in looks}) == len({s for _, s, _ in looks}) == len(_plot.DTYPES)
            assert all(line.get_markerfacecolor() == "none" for line in ax.get_lines())
            assert "(" in ax.get_xlabel() and ax.get_ylabel()
        pyplot.close(figure)
