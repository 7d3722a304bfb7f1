"""Each notebook that marks a 90-minute path states the class time its path counts
(tools/class_path.py), fits in 90 minutes, and the README's tables say the same."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from class_path import PATH_LINE, read_path  # noqa: E402

NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb")
                   if PATH_LINE.search(nbformat.read(p, as_version=4).cells[0].source))


def readme_minutes(notebook: Path) -> list[int]:
    """The class minutes the README's tour and exercises table give the notebook."""
    key = notebook.name.split("_")[0]
    rows = [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith(f"| {key} |") or f"(notebooks/{notebook.name})" in line]
    return [int(m) for row in rows for m in re.findall(r"(\d+) min class", row)]


def test_the_paths_cover_the_notebooks_of_this_round():
    names = {p.name.split("_")[0] for p in NOTEBOOKS}
    assert {"01", "02", "02b", "03", "03b", "04", "05", "07"} <= names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_stated_class_time_is_the_counted_one(notebook):
    path = read_path(nbformat.read(notebook, as_version=4))
    assert path.stated == path.class_minutes, \
        f"{notebook.name} states {path.stated} min, its path counts {path.class_minutes}: " \
        f"python tools/class_path.py {notebook.relative_to(ROOT)}"
    assert path.class_minutes <= 90
    assert readme_minutes(notebook) == [path.class_minutes] * 2, \
        f"README.md's tour and exercises table must say '{path.class_minutes} min class' " \
        f"for {notebook.name}"


def test_a_section_outside_the_path_is_an_error():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# t\n\n**90-minute path**: class 5 min\n* class: A"),
        nbformat.v4.new_markdown_cell("## A\n\nwords"),
        nbformat.v4.new_markdown_cell("## B\n\nmore words")])
    with pytest.raises(ValueError, match="'B' is in none"):
        read_path(nb)
