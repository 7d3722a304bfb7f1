"""Modules that moved into `pipeline_lib.course` still import from their old paths, as the
same module objects, with a `DeprecationWarning` that names the new path; the core imports
nothing from `course`."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_lib._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_imports_the_moved_module_and_says_where_it_went(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_a_submodule_under_an_old_path_imports_too():
    sys.modules.pop("pipeline_lib.notebook_workers.results", None)
    with pytest.warns(DeprecationWarning):
        from pipeline_lib.notebook_workers.results import load  # noqa: F401
    from pipeline_lib.course.workers import results
    assert load is results.load


def test_a_learners_old_notebook_line_still_runs():
    """``from pipeline_lib.exercises import exercise``, as the notebooks handed out before
    the move say, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                          "from pipeline_lib.exercises import exercise"],
                         capture_output=True, text=True, cwd=ROOT)
    assert "pipeline_lib.course.exercises" in out.stderr      # refused only under -W error
    out = subprocess.run([sys.executable, "-c", "from pipeline_lib.exercises import exercise; "
                          "print(exercise.__module__)"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "pipeline_lib.course.exercises"


def test_the_core_imports_nothing_from_course():
    core = [p for p in (ROOT / "pipeline_lib").rglob("*.py")
            if not {"course", "lm", "viz"} & set(p.relative_to(ROOT / "pipeline_lib").parts)]
    for path in core:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith("pipeline_lib.course") for n in names), path


def test_a_moved_package_stays_a_package_after_its_old_path_is_imported():
    """Importing the old path set the moved package's ``__spec__`` to the alias's, which
    has no location: ``importlib.resources.files`` then said "not a package"."""
    out = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c",
                          "import importlib.resources, pipeline_lib.notebook_workers\n"
                          "from pipeline_lib.course import workers\n"
                          "print(workers.__spec__.name)\n"
                          "print(importlib.resources.files('pipeline_lib.course.workers')"
                          ".joinpath('results.py').is_file())"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pipeline_lib.course.workers", "True"]
