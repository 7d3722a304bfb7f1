"""`make student` (tools/student.py) protects the check cells as nbgrader's
``generate_assignment`` does, so that a student folder can be handed out in place of
nbgrader's ``release/``: locked cells, and checksums that ``nbgrader validate`` compares."""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbgrader import utils
from nbgrader.validator import Validator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from student import student_version  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_check_cells_are_locked_and_checksummed_as_nbgrader_does(notebook):
    nb = student_version(notebook)
    graded = [cell for cell in nb.cells if utils.is_grade(cell)]
    solutions = [cell for cell in nb.cells if utils.is_solution(cell)]
    assert graded and solutions
    for cell in graded:
        assert cell.metadata["editable"] is False and cell.metadata["deletable"] is False
    for cell in solutions:                     # the learner's cell: editable, not deletable
        assert cell.metadata["deletable"] is False and cell.metadata.get("editable", True)
    for cell in graded + solutions:
        assert cell.metadata.nbgrader["checksum"] == utils.compute_checksum(cell)


def changed_cells(nb: nbformat.NotebookNode, folder: Path) -> list[dict]:
    """What ``nbgrader validate`` reports as changed test cells (its checksum comparison,
    without executing the notebook: ``preprocessors=[]``)."""
    path = folder / "submitted.ipynb"
    nbformat.write(nb, path)
    return Validator(preprocessors=[]).validate(str(path)).get("changed", [])


def test_nbgrader_validate_notices_an_edited_check_cell(tmp_path):
    nb = student_version(ROOT / "notebooks" / "06_torch_pipelining.ipynb")
    assert changed_cells(nb, tmp_path) == []
    solution = next(cell for cell in nb.cells if utils.is_solution(cell)
                    and not utils.is_grade(cell))
    solution.source = solution.source.replace("raise NotImplementedError()", "pass")
    assert changed_cells(nb, tmp_path) == []               # answering is not tampering
    check = next(cell for cell in nb.cells if utils.is_grade(cell))
    check.source = "print('passed')  # the check, replaced"
    changed = changed_cells(nb, tmp_path)
    assert [c["source"] for c in changed] == [check.source]
