"""`pipeline_lib.viz.explorer`: sliders that nbclient's own client (nbconvert, nbgrader)
runs without waiting out the cell timeout, and that draw again when a control moves.

ipywidgets' ``interact`` fills an Output widget while its cell runs; nbclient's imitation
of that widget then can swallow the cell reply's wake-up, and the cell waits out its
timeout (tests/notebook_client.py says how). These tests use nbclient's client as
nbconvert and nbgrader build it, imitation included.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from notebook_client import execute_timed

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
DISPLAYS = 200      # as in test_notebook_client: enough that interact's reply always comes
                    # while nbclient still answers the widget's outputs

SETUP = """
%matplotlib inline
import matplotlib.pyplot as plt
from IPython.display import display
from pipeline_lib.viz import explorer as module
from pipeline_lib.viz.explorer import explorer

shown = []                      # what explorer displays, kept to look into it

def displayed(box):
    shown.append(box)
    display(box)

module.display = displayed
"""

DRAWS = f"""
def draw(p=4, name="a"):
    for i in range({DISPLAYS}):
        display(i)
    plt.plot(range(p))
    plt.show()
    print(f"drew p = {{p}}, {{name}}")
"""


def run(*sources: str, tmp_path: Path) -> tuple[list, dict[int, float]]:
    """Run these cells with nbclient's own client; return the cells and how long the
    client waited for each one's reply."""
    nb = new_notebook(cells=[new_code_cell(source) for source in sources])
    waited = execute_timed(NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                          allow_errors=True,
                                          resources={"metadata": {"path": str(tmp_path)}}))
    return nb.cells, waited


def errors(cell) -> list[tuple[str, str]]:
    return [(o["ename"], o["evalue"]) for o in cell.outputs if o["output_type"] == "error"]


def test_nbclients_own_client_gets_the_reply_of_an_explorer_cell_at_once(tmp_path):
    cells, waited = run(SETUP, DRAWS, """
explorer(draw, p=(2, 8), name=["a", "b"])
outputs = shown[-1].children[-1].outputs
assert [o["data"]["text/plain"] for o in outputs[:3]] == ["0", "1", "2"]
assert "image/png" in outputs[-2]["data"] and outputs[-1]["text"] == "drew p = 4, a\\n"
""", "2", tmp_path=tmp_path)
    assert not any(errors(cell) for cell in cells), [errors(cell) for cell in cells]
    assert waited[2] < TIMEOUT_S / 2, \
        f"nbclient waited {waited[2]:.0f} s (the timeout is {TIMEOUT_S} s) for the explorer"
    widgets = [o for o in cells[2].outputs if o["output_type"] == "display_data"]
    assert widgets and "application/vnd.jupyter.widget-view+json" in widgets[0]["data"]
    assert cells[3].outputs[0]["data"]["text/plain"] == "2"     # and the next cell runs


def test_moving_a_control_draws_again_and_an_error_is_shown_in_place(tmp_path):
    cells, _ = run(SETUP, DRAWS, """
explorer(draw, p=(2, 8), name=["a", "b"])
box = shown[-1]
assert "widget-interact" in box._dom_classes    # styled and found as interact's box is
box.children[0].value = 6
box.children[1].value = "b"
assert box.children[-1].outputs[-1]["text"] == "drew p = 6, b\\n"

def fails(p=3):
    if p > 3:
        raise ValueError(f"no chart for p = {p}")
    print("fine")

explorer(fails, p=(2, 8))
box = shown[-1]
box.children[0].value = 5
assert "ValueError: no chart for p = 5" in box.children[-1].outputs[0]["text"]

def flags(fast=False, p=3):          # as interact: a control for every default
    print(f"fast = {fast}, p = {p}")

explorer(flags, p=(2, 8))
box = shown[-1]
assert [w.description for w in box.children[:-1]] == ["fast", "p"]
box.children[0].value = True
assert box.children[-1].outputs[-1]["text"] == "fast = True, p = 3\\n"
""", """explorer(fails, p=(4, 8))""", tmp_path=tmp_path)
    assert not errors(cells[2]), errors(cells[2])
    assert errors(cells[3]) == [("ValueError", "no chart for p = 4")]   # the defaults': the cell's


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")),
                         ids=lambda path: path.stem)
def test_no_notebook_calls_interact(notebook):
    """interact in a notebook stalls nbconvert and nbgrader; explorer does not."""
    code = "\n".join(c.source for c in nbformat.read(notebook, as_version=4).cells
                     if c.cell_type == "code")
    assert not re.search(r"\binteract\(", code), \
        f"{notebook.name} calls ipywidgets' interact: use pipeline_lib.viz.explorer.explorer"
