"""The benchmarks' figures (bench/_plot.py): a PNG with every series drawn in its colour, and
without matplotlib no file and a line saying so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # last: shadows nothing
from _plot import COLORS, Figure, Panel, Series, save

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def tiny_figure(panels: int) -> Figure:
    """A small table's figure: per panel a rising and a flat series."""
    rising = Series("rising", [(1024, 100.0), (2048, 400.0), (4096, 1600.0)])
    flat = Series("flat", [(1024, 50.0), (2048, 55.0), (4096, 60.0)])
    return Figure(
        title="A figure of a tiny table",
        x_label="tokens",
        y_label="ms",
        panels=[Panel(f"panel {n}", [rising, flat]) for n in range(panels)],
        caption="the machine, the command",
        x_tick=lambda x: f"{x / 1024:g}k",
    )


def pixels_of(path: Path, color: str) -> int:
    """How many pixels of path are color (exactly, as a line's middle is drawn)."""
    colors, image = (pytest.importorskip(f"matplotlib.{name}") for name in ("colors", "image"))
    rgb = colors.to_rgb(color)
    pixels = image.imread(path)[..., :3]
    return int((abs(pixels - rgb) < 1 / 255).all(axis=-1).sum())


@pytest.mark.parametrize("panels", [1, 2])
def test_a_figure_is_a_png_with_every_series_drawn(tmp_path: Path, panels: int) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "figure.png"

    assert save(tiny_figure(panels), path)

    assert path.read_bytes().startswith(PNG_SIGNATURE)
    for color in COLORS[:2]:  # a line and its markers: ~1,500 pixels; its legend key ~130
        assert pixels_of(path, color) > 1000 * panels, f"no series drawn in {color}"
    assert pixels_of(path, COLORS[2]) == 0  # a colour no series has is not in the picture


def test_without_matplotlib_no_png_is_drawn_and_the_bench_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import finds when absent
    path = tmp_path / "figure.png"

    assert not save(tiny_figure(1), path)

    assert not path.exists()
    assert f"{path} not drawn: matplotlib is not installed" in capsys.readouterr().err
