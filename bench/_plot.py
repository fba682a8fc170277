"""The benchmarks' figures: line charts of a table's figures, drawn from the same run.

matplotlib is a dev extra, imported only when a figure is drawn: a bench runs without it and
says its PNG was not drawn. The Agg backend draws without a screen.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# One colour and marker per series, in order: told apart in colour and in grey.
COLORS: Final = ("#1f5fa8", "#c8402f", "#2f8f3a", "#8a5a9e")
MARKERS: Final = ("o", "s", "^", "D")
PANEL_INCHES: Final = (6.4, 5.6)  # width, height of one panel
CAPTION_PER_INCH: Final = 16  # characters of the 8-point caption an inch of width holds


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (x, y), in x order


@dataclass(frozen=True)
class Panel:
    title: str
    series: Sequence[Series]


@dataclass(frozen=True)
class Figure:
    title: str
    x_label: str
    y_label: str
    panels: Sequence[Panel]
    caption: str
    x_tick: Callable[[float], str]  # the label of a tick at each x the data has
    log_y: bool = True


def machine_caption(note: str = "") -> str:
    """What ran the figure: the platform, its cores and their load, and the command."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    parts = [
        f"{platform.system()} {platform.release()} {platform.machine()}",
        f"{os.cpu_count()} cores, load {load:.1f} at the end of the run (other work included)",
        *([note] if note else []),
        f"bench/{command}",
    ]
    return "; ".join(parts)


def save(figure: Figure, path: Path) -> bool:
    """Draw figure into path as a PNG; False (and said on stderr) without matplotlib."""
    try:  # imported here: a dev extra, needed by no bench's measurements
        import matplotlib  # noqa: PLC0415
    except ImportError:
        print(f"{path} not drawn: matplotlib is not installed (kvd's dev extras)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker  # noqa: PLC0415

    columns = len(figure.panels)
    drawing, axes = pyplot.subplots(
        1,
        columns,
        figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1]),
        squeeze=False,
        layout="constrained",
    )
    for panel, ax in zip(figure.panels, axes[0], strict=True):
        xs = sorted({x for series in panel.series for x, _ in series.points})
        for index, series in enumerate(panel.series):
            ax.plot(
                [x for x, _ in series.points],
                [y for _, y in series.points],
                color=COLORS[index % len(COLORS)],
                marker=MARKERS[index % len(MARKERS)],
                linewidth=2,
                markersize=6,
                label=series.label,
            )
        ax.set_xscale("log")
        if figure.log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:,.6g}"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(ticker.FixedLocator(xs))
        ax.xaxis.set_major_formatter(ticker.FixedFormatter([figure.x_tick(x) for x in xs]))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xlabel(figure.x_label)
        ax.set_ylabel(figure.y_label)
        ax.set_title(panel.title)
        ax.grid(True, which="major", alpha=0.3)
        # Below the panel: inside, it would hide a line somewhere.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=9, frameon=False)
    drawing.suptitle(figure.title, fontsize=13)
    caption = "\n".join(
        textwrap.wrap(figure.caption, int(CAPTION_PER_INCH * PANEL_INCHES[0] * columns))
    )
    drawing.supxlabel(caption, fontsize=8, color="#444444")
    drawing.savefig(path, dpi=110)
    pyplot.close(drawing)
    print(f"drew {path}", file=sys.stderr)
    return True
