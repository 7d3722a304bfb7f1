"""Write the student versions of the notebooks: ``make student`` (into ``student/``).

The notebooks in ``notebooks/`` are the instructor versions: every exercise's solution sits
between nbgrader's ``### BEGIN SOLUTION`` and ``### END SOLUTION`` marks, and every
notebook is stored with its outputs. A student version is the same notebook passed through
nbgrader's own preprocessors: ``ClearSolutions`` turns each solution region into
``raise NotImplementedError()`` (and refuses a region in a cell not marked as a solution),
and ``ClearOutput`` empties every output, so the stored answers do not give the exercise
away. The check cells get the protection nbgrader's ``generate_assignment`` gives them, by
the same preprocessors, in its order: ``LockCells`` marks them ``editable: false`` and
``deletable: false`` (a solution cell stays editable, not deletable), and
``ComputeChecksums`` stores each graded, solution or locked cell's checksum, as
``nbgrader.utils.compute_checksum`` computes it, so that ``nbgrader validate`` (and
autograding) report a check cell a learner edited. So a ``make student`` folder can be
handed out in place of nbgrader's ``release/``.

The folder is the learner's: once they have typed answers into ``student/01_....ipynb``,
running ``make student`` again must not wipe them. So a notebook already there is written
only if it is missing; one that differs from what would be written (the learner's work, or
an older student version) is left as it is, and the command says which and how to get the
fresh one. Each file is written to a temporary name and renamed into place, so a full disk
or an interrupt leaves either the whole new notebook or nothing, never half of one.
``student/`` sits beside ``notebooks/`` so that relative paths in the notebooks hold,
and it is not committed. Instructors who grade with nbgrader can use ``notebooks/`` as their
``source/`` folder instead: the cells carry nbgrader's metadata.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbgrader.preprocessors import (CheckCellMetadata, ClearOutput, ClearSolutions,
                                     ComputeChecksums, LockCells)

ROOT = Path(__file__).resolve().parents[1]


def student_version(notebook: Path) -> nbformat.NotebookNode:
    """The notebook as a learner gets it: solutions replaced by stubs, no outputs, the
    check cells locked and checksummed as nbgrader's ``generate_assignment`` does."""
    nb = nbformat.read(notebook, as_version=nbformat.NO_CONVERT)
    resources: dict = {}
    for preprocessor in (LockCells(), ClearSolutions(), ClearOutput(), CheckCellMetadata(),
                         ComputeChecksums()):
        nb, resources = preprocessor.preprocess(nb, resources)
    return nb


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` afterwards, or is as it was: written under a temporary name
    in the same folder, then renamed over it (a rename within a folder is atomic)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("w", encoding="utf8") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def holds(path: Path, text: str) -> bool:
    """Whether ``path`` is a file holding exactly ``text``. Anything else there (a folder,
    a link to nowhere, a file in another encoding or one this user cannot read) is the
    learner's, to be kept, not a reason to stop with a traceback."""
    try:
        return path.is_file() and path.read_bytes() == text.encode("utf8")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "student",
                        help="folder to write them into (default: student/)")
    args = parser.parse_args(argv)
    if args.out.resolve() == (ROOT / "notebooks").resolve():
        parser.error(f"{args.out} holds the instructor versions, which the student "
                     f"versions are made from; write them elsewhere (default: student/)")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"cannot make the folder {args.out} ({error.strerror or error}); give "
                     f"a folder you can write, or a path where one can be made")
    kept = []
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        path = args.out / notebook.name
        text = nbformat.writes(student_version(notebook))
        if not text.endswith("\n"):
            text += "\n"
        if path.exists() or path.is_symlink():
            if holds(path, text):
                print(f"up to date: {path}")
            else:
                kept.append(path)
                print(f"kept {path}: it differs from a fresh student version (your answers?), "
                      f"so it was not overwritten")
            continue
        try:
            write_atomically(path, text)
        except OSError as error:
            print(f"could not write {path}: {error.strerror or error}. Nothing was written "
                  f"under that name; free some space (or write elsewhere: python "
                  f"tools/student.py FOLDER), then run it again", file=sys.stderr)
            return 1
        print(f"wrote {path}")
    if kept:
        print("To get a fresh copy of a kept notebook, rename or delete it and run make "
              "student again.")
    print(f"Open them with: make lab FOLDER={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
