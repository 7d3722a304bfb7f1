"""The tests' notebook client (tests/notebook_client.py) gets a cell's reply as soon as the
kernel sends it, even when the cell fills an ipywidgets Output widget, and keeps what the
widget shows in the cell's outputs.

nbclient's own client, on the cell below, waits out its whole timeout and then reports
success (its imitated Output widget swallows the reply's wake-up; the module docstring of
notebook_client says how). In the exercise test that was a 5-minute stall in notebook 02's
``interact`` cell, seen in CI.
"""
from __future__ import annotations

from nbformat.v4 import new_code_cell, new_notebook

from notebook_client import execute_timed, notebook_client

TIMEOUT_S = 60        # per cell; the cells below take well under a second in the kernel
DISPLAYS = 200        # outputs sent into the widget: with nbclient's client, enough that
                      # the reply always arrives while the client still answers them


def run(*sources: str, tmp_path) -> tuple[list, dict[int, float]]:
    """Run one notebook of these cells; return its cells and how long the client waited
    for each (from sending the cell to having its reply and outputs)."""
    nb = new_notebook(cells=[new_code_cell(source) for source in sources])
    waited = execute_timed(notebook_client(nb, tmp_path, TIMEOUT_S, allow_errors=True))
    return nb.cells, waited


def test_a_cell_filling_an_output_widget_does_not_wait_out_the_timeout(tmp_path):
    cells, waited = run("1", f"""
from IPython.display import display
from ipywidgets import Output
out = Output()
display(out)
with out:
    for i in range({DISPLAYS}):
        display(i)
""", "2", tmp_path=tmp_path)
    assert waited[1] < TIMEOUT_S / 2, \
        f"the client waited {waited[1]:.0f} s (the timeout is {TIMEOUT_S} s) for a cell " \
        f"that displays {DISPLAYS} numbers: the reply's wake-up was lost"
    shown = [o["data"]["text/plain"] for o in cells[1].outputs
             if o["output_type"] == "display_data" and "text/plain" in o["data"]]
    assert shown[-DISPLAYS:] == [str(i) for i in range(DISPLAYS)], \
        "what the Output widget shows belongs in its cell's outputs"
    assert cells[2].outputs[0]["data"]["text/plain"] == "2"   # and the next cell runs


def test_an_error_in_an_interact_callback_is_an_error_of_its_cell(tmp_path):
    """notebook 02's explorer runs in ``interact``: if it raises, the exercise test must see
    it, so the error has to be in the cell's outputs, not only in the widget."""
    cells, _ = run("""
from ipywidgets import interact

def explore(p=4):
    raise ValueError(f"no explorer for p = {p}")

interact(explore, p=(2, 8))
""", tmp_path=tmp_path)
    errors = [o for o in cells[0].outputs if o["output_type"] == "error"]
    assert [(e["ename"], e["evalue"]) for e in errors] == [("ValueError", "no explorer for p = 4")]
