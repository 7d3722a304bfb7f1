"""How long a notebook's class takes, counted from the 90-minute path its introduction
marks: ``python tools/class_path.py notebooks/01_naive_model_parallelism.ipynb``.

A notebook's first cell marks its path with up to three lines (each a list of section
headings, or their first words, separated by " · "; a kind with no section is left out)::

    **90-minute path**: class 75 min, ...
    * class: Setup · A model cut into stages · ... · Exercise 1.1 · Exercise 1.2
    * reading: Appendix
    * homework: Exercise 1.4

Every section (a ``##`` heading, or a ``### Exercise`` heading) belongs to exactly one of
them. A section of the class costs its prose read and discussed at 100 words a minute and
a minute per code cell, an exercise 10 minutes (15 for a harder one); the first cell's
own prose counts too. The total is rounded up to 5 minutes, and is what the notebook's
first line and the README's "in class" column say (tests/test_class_path.py checks both).
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

WORDS_PER_MINUTE = 100
MINUTES_PER_CODE_CELL = 1
EXERCISE_MINUTES, HARDER_EXERCISE_MINUTES = 10, 15
KINDS = ("class", "reading", "homework")
PATH_LINE = re.compile(r"^\* (class|reading|homework): (.+)$", re.MULTILINE)
STATED = re.compile(r"\*\*90-minute path\*\*: class (\d+) min")


@dataclass
class Section:
    """One part of a notebook: a ``##`` section (its ``###`` subsections included, but not
    its exercises) or one exercise."""

    title: str
    words: int = 0
    code_cells: int = 0
    exercise: bool = False

    @property
    def minutes(self) -> float:
        if self.exercise:
            return HARDER_EXERCISE_MINUTES if "harder" in self.title.lower() else EXERCISE_MINUTES
        return self.words / WORDS_PER_MINUTE + self.code_cells * MINUTES_PER_CODE_CELL


@dataclass
class Path90:
    """A notebook's sections by kind, and the class minutes its first cell states."""

    sections: dict[str, list[Section]] = field(default_factory=dict)
    intro: Section = field(default_factory=lambda: Section("(introduction)"))
    stated: int | None = None

    @property
    def class_minutes(self) -> int:
        total = self.intro.minutes + sum(s.minutes for s in self.sections["class"])
        return 5 * math.ceil(total / 5)


def sections(nb: nbformat.NotebookNode) -> tuple[Section, list[Section]]:
    """The first cell's part and the notebook's sections, in order: a markdown cell's
    words go to the heading above them, in that cell or an earlier one."""
    intro, found = Section("(introduction)"), []
    current = intro
    for k, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            current.code_cells += 1
            continue
        for line in cell.source.splitlines():
            heading = re.match(r"(### Exercise|## )\s*(.+)$", line)
            if heading and k > 0:
                exercise = heading.group(1) == "### Exercise"
                current = Section(("Exercise " if exercise else "") + heading.group(2).strip(),
                                  exercise=exercise)
                found.append(current)
            current.words += len(line.split())
    return intro, found


def read_path(nb: nbformat.NotebookNode) -> Path90:
    """The notebook's path: which section is class, reading or homework, by the first
    cell's three lines. Raises `ValueError` when a section is in none or in two."""
    first = nb.cells[0].source
    entries = {kind: [e.strip() for e in text.split(" · ") if e.strip()]
               for kind, text in PATH_LINE.findall(first)}
    if "class" not in entries:
        raise ValueError("the first cell marks no 90-minute path (a line '* class: ...')")
    intro, parts = sections(nb)
    path = Path90({kind: [] for kind in KINDS}, intro)
    stated = STATED.search(first)
    path.stated = int(stated.group(1)) if stated else None
    for part in parts:
        kinds = [kind for kind, names in entries.items()
                 if any(part.title.startswith(name) for name in names)]
        if len(kinds) != 1:
            raise ValueError(f"section {part.title!r} is in {kinds or 'none'} of the path's "
                             f"lists; it must be in exactly one")
        path.sections[kinds[0]].append(part)
    return path


def main(argv: list[str]) -> int:
    for name in argv:
        path = read_path(nbformat.read(Path(name), as_version=4))
        print(f"{name}: class {path.class_minutes} min (stated: {path.stated})")
        for kind in KINDS:
            for part in path.sections[kind]:
                print(f"  {kind:8} {part.minutes:5.1f} min  {part.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
