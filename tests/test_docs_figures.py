"""The README's "Measured" figures against docs/benchmarks.md: each row's command is the one the
benchmark's section documents, and every number of its figure stands in that section, so the
two cannot drift apart; the rows of "the figure's run" are the runs the figures show."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
SCRIPT = re.compile(r"bench/\w+\.py")
FIGURE = re.compile(r"!\[[^]]*\]\((docs/figures/[\w.]+)\) `([^`]+)`")
FIGURES_RUN = "the figure's run"


@dataclass(frozen=True)
class Row:
    what: str
    figure: str
    command: str

    @property
    def script(self) -> str:
        found = SCRIPT.search(self.command)
        assert found is not None, f"{self.what}: no bench/ script in {self.command!r}"
        return found.group()


def _measured() -> str:
    return README.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]


def measured_rows() -> list[Row]:
    """The Measured table's rows; a command of "same runs" is the row's above."""
    rows: list[Row] = []
    for line in _measured().splitlines():
        if not line.startswith("| ") or line.startswith("| what |"):
            continue
        what, figure, command = (cell.strip() for cell in line.strip("|").split(" | "))
        code = re.search(r"`([^`]+)`", command)
        rows.append(Row(what, figure, code.group(1) if code else rows[-1].command))
    return rows


def sections() -> dict[str, str]:
    """docs/benchmarks.md's benchmark sections (### headings) by heading, their ####
    subsections included, white space folded (commands wrap)."""
    found = {}
    for part in re.split(r"\n(?=##+ )", BENCHMARKS):
        heading, _, body = part.partition("\n")
        if heading.startswith("### "):
            found[heading.removeprefix("### ")] = " ".join(body.split())
        elif heading.startswith("#### "):
            last = next(reversed(found))
            found[last] += " " + heading + " " + " ".join(body.split())
    return found


def section_of(script: str) -> str:
    """The one section whose Command (or Commands) names script."""
    named = [
        text
        for text in sections().values()
        if (command := re.match(r"- Commands?: (.*?)(?: - |$)", text))
        and script in command.group(1)
    ]
    assert len(named) == 1, f"{script} is the command of {len(named)} sections"
    return named[0]


def figures_run(section: str) -> str:
    """The section's subsection of the run its figure was drawn from."""
    runs = [part for part in section.split(" #### ") if part.startswith("The figure's run")]
    assert len(runs) == 1, "no subsection of the figure's run"
    return runs[0]


def stands_in(number: str, text: str) -> bool:
    """Whether number stands in text whole (1.1 is not 1.14, nor 11.1, nor 1.1.2)."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", text) is not None


ROWS = measured_rows()


def test_the_measured_table_is_read() -> None:
    assert len(ROWS) >= 15
    assert all(NUMBER.search(row.figure) for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row.what for row in ROWS])
def test_a_measured_figure_stands_in_its_benchmarks_section(row: Row) -> None:
    section = section_of(row.script)
    assert row.command in section, f"{row.command!r} is not the section's command"
    if FIGURES_RUN in row.what:  # its numbers, the figure's run's: not another run's
        section = figures_run(section)
    missing = [n for n in NUMBER.findall(row.figure) if not stands_in(n, section)]
    assert not missing, f"{row.what}: {missing} not in the section of {row.script}"


def test_the_rows_of_the_figures_run_are_the_figures_commands() -> None:
    figures = dict(FIGURE.findall(_measured()))
    assert len(figures) == 2
    for path, command in figures.items():
        assert (ROOT / path).is_file()
        assert command in " ".join(BENCHMARKS.split())
        assert any(FIGURES_RUN in row.what and row.command == command for row in ROWS), command
    assert all(row.command in figures.values() for row in ROWS if FIGURES_RUN in row.what)


def test_every_benchmark_section_has_a_command_and_is_in_the_contents() -> None:
    contents = BENCHMARKS.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    for heading, text in sections().items():
        assert text.startswith(("- Command: ", "- Commands: ")), heading
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        assert f"(#{slug})" in contents, heading


@pytest.mark.parametrize(
    ("number", "text", "stands"),
    [
        ("1.1", "1.14×", False),
        ("1.1", "11.1 s", False),
        ("1.1", "(1.1×)", True),
        ("1,124.0", "1,124.0 (1,014–1,192)", True),
        ("16", "**16**", True),
        ("6", "6–12", True),
        ("12", "1,120", False),
        ("2.5", "2.5-3.4×", True),
    ],
)
def test_a_number_stands_in_a_text_only_whole(number: str, text: str, stands: bool) -> None:
    assert stands_in(number, text) is stands
