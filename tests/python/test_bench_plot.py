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
