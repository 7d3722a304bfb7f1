"""Write the student versions of the notebooks: ``make student`` (into ``student/``).

The notebooks in ``notebooks/`` are the instructor versions: every exercise's solution sits
between nbgrader's ``### BEGIN SOLUTION`` and ``### END SOLUTION`` marks, and every
notebook is stored with its outputs. A student version is the same notebook passed through
nbgrader's own preprocessors: ``ClearSolutions`` turns each solution region into
``raise NotImplementedError()`` (and refuses a region in a cell not marked as a solution),
and ``ClearOutput`` empties every output, so the stored answers do not give the exercise
away. ``student/`` sits beside ``notebooks/`` so that relative paths in the notebooks hold,
and it is not committed. Instructors who grade with nbgrader can use ``notebooks/`` as their
``source/`` folder instead: the cells carry nbgrader's metadata.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbgrader.preprocessors import ClearOutput, ClearSolutions

ROOT = Path(__file__).resolve().parents[1]


def student_version(notebook: Path) -> nbformat.NotebookNode:
    """The notebook as a learner gets it: solutions replaced by stubs, no outputs."""
    nb = nbformat.read(notebook, as_version=nbformat.NO_CONVERT)
    resources: dict = {}
    for preprocessor in (ClearSolutions(), ClearOutput()):
        nb, resources = preprocessor.preprocess(nb, resources)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "student",
                        help="folder to write them into (default: student/)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nbformat.write(student_version(notebook), args.out / notebook.name)
        print(f"wrote {args.out / notebook.name}")
    print(f"Open them with: make lab FOLDER={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
