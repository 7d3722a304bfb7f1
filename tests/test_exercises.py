"""The exercises can fail: on the student version (nbgrader's stubs) every check fails with
its own exercise's message, and on the instructor version (``notebooks/``) every one passes.

A check that passed on the stub would grade every learner right; a check that failed on the
solution would grade every learner wrong. Both are bugs this file exists to catch.
"""
from __future__ import annotations

import ast
import builtins
import errno
import io
import re
import sys
from pathlib import Path

import nbformat
import pytest

import notebook_slice
from conftest import notebook_needs_wikitext
from notebook_client import notebook_client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from student import main as make_student, student_version  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAME = re.compile(r"""with exercise\((["'])(.+?)\1\)""")
RUN_S = 300        # one notebook, cell timeout; the notebooks run in under two minutes


def nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def checks(nb) -> list[tuple[int, str]]:
    """(cell index, exercise name) of every autograded check cell."""
    found = []
    for i, cell in enumerate(nb.cells):
        if nbgrader(cell).get("grade"):
            match = NAME.search(cell.source)
            assert match, f"check cell {nbgrader(cell).get('grade_id')} has no " \
                          f"`with exercise(\"...\")` block"
            found.append((i, match.group(2)))
    return found


def errors(cell) -> list[dict]:
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def params():
    return [pytest.param(nb, id=nb.stem,
                         marks=[pytest.mark.wikitext2] if notebook_needs_wikitext(nb) else [])
            for nb in NOTEBOOKS]


@pytest.mark.parametrize("notebook", params())
def test_instructor_version_is_marked_for_nbgrader_and_passes(notebook):
    nb = nbformat.read(notebook, as_version=4)
    found = checks(nb)
    assert len(found) >= 2, f"{notebook.name} has {len(found)} exercises; every notebook " \
                            f"needs at least two"
    names = [name for _, name in found]
    assert len(set(names)) == len(names), f"{notebook.name}: two checks share a name"
    ids = [nbgrader(c)["grade_id"] for c in nb.cells if nbgrader(c)]
    assert len(set(ids)) == len(ids), f"{notebook.name}: nbgrader grade_ids must be unique"
    for cell in nb.cells:
        meta = nbgrader(cell)
        if meta.get("solution"):
            assert "### BEGIN SOLUTION" in cell.source and "### END SOLUTION" in cell.source
        if meta.get("grade"):
            assert meta.get("points", 0) > 0 and meta.get("locked"), meta
    for i, name in found:      # the stored outputs: nbval re-runs them and compares
        cell = nb.cells[i]
        assert not errors(cell), f"{notebook.name}: {name} fails on its solution"
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert f"{name}: passed" in text, f"{notebook.name}: {name} did not print that it passed"


def test_enough_exercises_ask_for_code():
    """A solution that defines a function or class asks for code, not a number."""
    code = [cell for nb in NOTEBOOKS for cell in nbformat.read(nb, as_version=4).cells
            if nbgrader(cell).get("solution") and cell.cell_type == "code"
            and re.search(r"^\s*(def|class) ", cell.source.split("### BEGIN SOLUTION")[0],
                          re.MULTILINE)]
    assert len(code) >= 8, f"only {len(code)} exercises ask for code"


def imported(source: str) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for node in ast.walk(notebook_slice.parse(source))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}


@pytest.mark.timeout(len(NOTEBOOKS) * RUN_S)
@pytest.mark.parametrize("notebook", params())
def test_student_version_fails_every_check_with_its_message(notebook):
    """The student version differs from the instructor's only in its solution cells, so a
    cell that reads no name a solution binds runs as nbval runs it. Run the check cells,
    the stubs and the cells they need (`notebook_slice`); assert that no other cell reads
    a name only a solution binds (a learner's notebook would fail there)."""
    instructor = nbformat.read(notebook, as_version=4)
    nb = student_version(notebook)
    assert "### BEGIN SOLUTION" not in "".join(c.source for c in nb.cells)
    solutions = [i for i, cell in enumerate(nb.cells) if nbgrader(cell).get("solution")]
    only_solved = set().union(*(notebook_slice.bound(instructor.cells[i].source)
                                - imported(nb.cells[i].source) for i in solutions))
    graded = [i for i, _ in checks(nb)]
    run = notebook_slice.needed(nb, graded + solutions)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and i not in graded and i not in solutions:
            used = notebook_slice.read(cell.source) & only_solved
            assert not used, f"{notebook.name}: cell {i} uses {used}, which only a solution " \
                             f"defines: it fails in the student version\n{cell.source}"
    nb = notebook_slice.sliced(nb, run)
    notebook_client(nb, notebook.parent, RUN_S, allow_errors=True).execute()
    original = nb.metadata.pop("slice_of")
    for i, name in checks(nb):
        failures = errors(nb.cells[i])
        assert failures, f"{notebook.name}: {name} passed on the stub"
        assert failures[0]["ename"] == "ExerciseFailed" and \
            failures[0]["evalue"].startswith(f"{name}:"), \
            f"{notebook.name}: {name} failed with {failures[0]['ename']}: " \
            f"{failures[0]['evalue']}, not with its own message"
    for i, cell in enumerate(nb.cells):
        if not nbgrader(cell).get("grade") and not nbgrader(cell).get("solution"):
            assert not errors(cell), \
                f"{notebook.name}: cell {original[i]} fails in the student version, run " \
                f"with only the cells the checks need: {errors(cell)[0]['evalue']}\n" \
                f"{cell.source}"


def test_make_student_writes_every_notebook_without_solutions_or_outputs(tmp_path):
    make_student([str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [nb.name for nb in NOTEBOOKS]
    for path in tmp_path.iterdir():
        nb = nbformat.read(path, as_version=4)
        assert not any(c.get("outputs") for c in nb.cells), path.name
        assert "### BEGIN SOLUTION" not in "".join(c.source for c in nb.cells), path.name


def test_withheld_refuses_the_function_however_it_is_reached_and_restores_it():
    """A learner's call of the library function that is the answer fails by whichever
    route it reaches the function object: its name, an alias, a module attribute, a
    dict, a default argument bound before the check, ``__wrapped__``, another thread;
    and only inside the block."""
    import threading

    import pipeline_lib
    from pipeline_lib import schedules, timeline
    from pipeline_lib.course.exercises import ExerciseFailed, exercise, withheld

    original, builder = timeline.simulate, schedules.gpipe
    sim, table = original, {"gpipe": schedules.BUILDERS["gpipe"]}

    def captured(p, m, _build=builder):          # bound before the check ran
        return _build(p, m)

    def in_a_thread():
        caught = []
        worker = threading.Thread(target=lambda: caught.append(
            pytest.raises(ExerciseFailed, builder, 2, 2)))
        worker.start()
        worker.join()
        assert caught, "the thread did not run"
        raise ExerciseFailed("refused in a thread too")

    routes = [lambda: sim(builder(2, 2)), lambda: pipeline_lib.simulate(None),
              lambda: timeline.simulate(None), lambda: table["gpipe"](2, 2),
              lambda: captured(2, 2), lambda: builder.__wrapped__(2, 2),
              lambda: schedules.build("gpipe", 2, 2), in_a_thread]
    for route in routes:
        with pytest.raises(ExerciseFailed, match=r"^Exercise 0\.1 \(t\): (your code calls "
                                                 r"`(simulate|gpipe)`|refused in a thread)"):
            with exercise("Exercise 0.1 (t)"), withheld(original, builder):
                route()
    assert timeline.simulate is original and original.__code__.co_name == "simulate"
    assert captured(2, 3).microbatches == 3                  # restored, every route
    assert sim(builder(2, 4)).makespan > 0
    with pytest.raises(TypeError, match="functions"):
        with withheld(3):
            pass


def test_withheld_fails_the_block_when_the_learner_hides_a_refusal():
    from pipeline_lib.course.exercises import ExerciseFailed, withheld
    from pipeline_lib.microbatch import split

    def tries_the_library_first(x, m):
        try:
            return split(x, m)
        except Exception:                    # the refusal caught: then something else
            return [x]

    with pytest.raises(ExerciseFailed, match="`split`"):
        with withheld(split):
            assert tries_the_library_first([1, 2], 1) == [[1, 2]]
    assert len(split(__import__("torch").zeros(4), 2)) == 2


def test_withheld_restores_the_code_when_the_block_raises():
    from pipeline_lib.course.exercises import withheld
    from pipeline_lib.timeline import bubble_theory

    code = bubble_theory.__code__
    with pytest.raises(KeyError):
        with withheld(bubble_theory):
            raise KeyError("the learner's own error")
    assert bubble_theory.__code__ is code and bubble_theory(2, 4) == pytest.approx(1 / 5)


def test_withheld_takes_a_module_name_for_all_its_functions():
    from pipeline_lib import schedules, timeline
    from pipeline_lib.course.exercises import ExerciseFailed, withheld

    for call, name in [(lambda: timeline.simulate(schedules.gpipe(2, 2)), "simulate"),
                       (lambda: timeline.bubble_theory(2, 4), "bubble_theory")]:
        with pytest.raises(ExerciseFailed, match=f"`{name}`"):
            with withheld("pipeline_lib.timeline"):
                call()
    with withheld("pipeline_lib.timeline"):
        assert schedules.gpipe(2, 2).ranks == 2                   # another module: free
        assert timeline.Timeline(2, []).ranks == 2                # classes stay
    assert timeline.bubble_theory(2, 4) == pytest.approx(1 / 5)


def test_withheld_takes_a_class_and_refuses_making_one():
    from torch import nn

    from pipeline_lib.batchnorm import DeferredBatchNorm
    from pipeline_lib.course.exercises import ExerciseFailed, withheld
    from pipeline_lib.sync import Pipe as ClassicPipe
    from pipeline_lib.threaded import Pipe

    for make in [lambda: Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=1),
                 lambda: type("Mine", (Pipe,), {})(nn.Sequential(nn.Linear(2, 2)), chunks=1),
                 lambda: ClassicPipe(nn.Sequential(nn.Linear(2, 2)), chunks=1)]:
        with pytest.raises(ExerciseFailed, match="`Pipe`"):     # and what derives from it
            with withheld(Pipe):
                make()
    with withheld(Pipe):
        assert DeferredBatchNorm(2, chunks=2).num_features == 2  # other classes: free
    assert Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=1).chunks == 1


def test_withheld_says_the_reason_given():
    from pipeline_lib.course.exercises import ExerciseFailed, withheld
    from pipeline_lib.timeline import bubble_theory

    with pytest.raises(ExerciseFailed, match="^no `bubble_theory` here$"):
        with withheld(bubble_theory, reason="no `{name}` here"):
            bubble_theory(2, 2)


def test_withheld_refuses_a_module_without_functions(monkeypatch):
    import types

    from pipeline_lib.course.exercises import withheld

    monkeypatch.setitem(sys.modules, "pipeline_lib._empty", types.ModuleType("pipeline_lib._empty"))
    with pytest.raises(ValueError, match="defines no functions"):
        with withheld("pipeline_lib._empty"):
            pass


def test_hidden_cases_are_new_distinct_and_differ_between_runs():
    from pipeline_lib.course.exercises import hidden_cases

    shown = [(2, 3), (4, 5)]
    runs = [hidden_cases(lambda rng: (rng.randint(1, 9), rng.randint(1, 9)), 5, shown=shown)
            for _ in range(4)]
    for cases in runs:
        assert len(cases) == 5 == len(set(cases)) and not set(cases) & set(shown)
    assert len({tuple(cases) for cases in runs}) > 1
    with pytest.raises(ValueError, match="widen the range"):
        hidden_cases(lambda rng: rng.randint(1, 3), 3, shown=[1])


def test_make_student_again_keeps_the_learners_answers(tmp_path, capsys):
    make_student([str(tmp_path)])
    answered = tmp_path / NOTEBOOKS[0].name
    nb = nbformat.read(answered, as_version=4)
    nb.cells[0].source += "\nmy answer"
    nbformat.write(nb, answered)
    mine = answered.read_bytes()
    (tmp_path / NOTEBOOKS[1].name).unlink()                  # deleted to get a fresh one
    capsys.readouterr()
    assert make_student([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert answered.read_bytes() == mine
    assert f"kept {answered}" in out and "not overwritten" in out, out
    assert f"wrote {tmp_path / NOTEBOOKS[1].name}" in out, out
    assert f"up to date: {tmp_path / NOTEBOOKS[2].name}" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == [nb.name for nb in NOTEBOOKS]


class _FullDisk(io.StringIO):
    """A file on a disk that fills up after 100 characters: the first write gets that far."""

    def __init__(self, path, real_open):
        super().__init__()
        self.path, self.real_open = path, real_open

    def write(self, text):
        with self.real_open(self.path, "a", encoding="utf8") as f:
            f.write(text[:100])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_make_student_on_a_full_disk_leaves_no_half_notebook(tmp_path, monkeypatch, capsys):
    make_student([str(tmp_path)])
    answered = tmp_path / NOTEBOOKS[0].name
    nb = nbformat.read(answered, as_version=4)
    nb.cells[0].source += "\nmy answer"
    nbformat.write(nb, answered)
    mine = answered.read_bytes()
    missing = tmp_path / NOTEBOOKS[1].name
    missing.unlink()
    real_open = builtins.open

    def open_on_full_disk(file, mode="r", *args, **kwargs):
        if "w" in mode and Path(file).parent == tmp_path:
            return _FullDisk(file, real_open)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_on_full_disk)
    monkeypatch.setattr(io, "open", open_on_full_disk)
    capsys.readouterr()
    assert make_student([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert answered.read_bytes() == mine                     # the learner's notebook whole
    assert not missing.exists()                              # no half-written one
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted(nb.name for nb in NOTEBOOKS if nb.name != missing.name)   # no temporary left
    assert f"could not write {missing}" in err and "free some space" in err, err


def test_make_student_refuses_a_file_or_the_instructor_folder(tmp_path, capsys):
    """A file where the folder goes gave a raw FileExistsError."""
    afile = tmp_path / "student"
    afile.write_text("")
    for out, says in [(afile, "cannot make the folder"),
                      (ROOT / "notebooks", "holds the instructor versions")]:
        with pytest.raises(SystemExit) as exit_:
            make_student([str(out)])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err


def test_withheld_namespace_is_no_longer_needed():
    from pipeline_lib.course.exercises import withheld
    from pipeline_lib.timeline import bubble_theory

    with pytest.warns(DeprecationWarning, match="no longer needed"):
        with withheld(bubble_theory, namespace={"bubble_theory": bubble_theory}):
            pass


def test_withheld_refuses_copies_of_the_code_however_they_were_made():
    """The issue's routes past the swap: the code object copied into a new function before
    the check, the source run again (renamed), the module's source run again with a
    driver of one's own, and a copy run in a thread the learner starts; each refuses,
    naming the function, and the profile function is gone afterwards."""
    import inspect
    import threading

    import torch

    from copies import copied
    from pipeline_lib.course.exercises import ExerciseFailed, withheld
    from pipeline_lib.lm import chunked_loss
    from pipeline_lib.microbatch import split
    from pipeline_lib.partition import optimal_split

    made_before, renamed = copied(optimal_split), copied(split, "mine")
    module_copy = {"__name__": "my_copy"}
    exec(inspect.getsource(chunked_loss), module_copy)

    def in_a_thread():                  # the refusal caught there: the block still fails
        def run():
            try:
                made_before([1.0, 2.0], 2)
            except ExerciseFailed:
                pass
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()

    def drive_the_module_copy():
        head = torch.nn.Linear(3, 5)
        module_copy["chunked_loss_backward"](torch.randn(2, 4, 3), head,
                                             torch.randint(0, 5, (2, 4)), 2)

    for target, route, name in [
            (optimal_split, lambda: made_before([1.0, 2.0, 3.0], 2), "optimal_split"),
            (split, lambda: renamed(torch.zeros(4), 2), "split"),
            ("pipeline_lib.lm.chunked_loss", drive_the_module_copy, "chunked_loss_backward"),
            (optimal_split, in_a_thread, "optimal_split")]:
        with pytest.raises(ExerciseFailed, match=f"`{name}`.*a copy of its code"):
            with withheld(target):
                route()
    assert sys.getprofile() is None and threading.getprofile() is None
    assert made_before([1.0, 2.0, 3.0], 2) == optimal_split([1.0, 2.0, 3.0], 2)   # free again


def test_withheld_lets_another_modules_helper_written_alike_run():
    """`schedules._is_count` and `timeline._is_index` have the same code; withholding the
    timeline leaves the builders, which validate with the former, free."""
    from pipeline_lib import schedules, timeline
    from pipeline_lib.course.exercises import _signature, withheld

    assert _signature(schedules._is_count.__code__) == _signature(timeline._is_index.__code__)
    with withheld("pipeline_lib.timeline"):
        assert schedules.validate(schedules.gpipe(2, 2)) is None


def test_withheld_says_a_modules_helper_is_withheld_with_its_module():
    from pipeline_lib.course.exercises import ExerciseFailed, withheld
    from pipeline_lib.lm import chunked_loss

    with pytest.raises(ExerciseFailed) as refused:
        with withheld("pipeline_lib.lm.chunked_loss"):
            chunked_loss.counted_tokens(__import__("torch").zeros(2, 3, dtype=int))
    message = str(refused.value)
    assert "`counted_tokens`, which is withheld with the rest of its module, " \
           "`pipeline_lib.lm.chunked_loss`" in message and "very answer" in message
    assert "`counted_tokens`, which computes" not in message
