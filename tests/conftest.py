"""Shared test fixtures: where the CI-sized WikiText-2 copy lies, and one data check up front.

Notebooks 03 and 05 (under nbval, and as student versions) read WikiText-2 through
``load_wikitext2``. Without the data and without a network each of their cells used to fail
on its own, 21 failures that all meant one thing; so before any test runs, the session looks
for the data the way the notebooks do (and downloads it, as they would, when online), and
stops once with what to do if it cannot be had.
"""
import os
import signal
from functools import cache
from pathlib import Path

import pytest

MINI = Path(os.environ.get("PIPELINE_LIB_DATA")
            or Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-mini")
needs_mini = pytest.mark.skipif(
    not (MINI / "train.txt").is_file(),
    reason=f"WikiText-2 mini copy not found at {MINI}; set PIPELINE_LIB_DATA to a folder "
           "with train.txt, valid.txt and test.txt")


def assert_same_grads(model, reference, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every parameter of ``model`` got the gradient its twin in ``reference`` got."""
    import torch

    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


@cache
def notebook_needs_wikitext(path: Path) -> bool:
    """Whether a notebook loads WikiText-2 (read from its source, so a new one is covered)."""
    return "load_wikitext2(" in path.read_text(encoding="utf-8")


def wikitext_problem() -> str | None:
    """Why the notebooks could not get WikiText-2 now, or None when they can."""
    from pipeline_lib.lm.data import find_wikitext2

    try:
        find_wikitext2()
    except (OSError, RuntimeError) as err:      # not found, or the download failed
        return str(err)
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "wikitext2: needs WikiText-2 ($PIPELINE_LIB_DATA or a download)")
    config.addinivalue_line(
        "markers", "alone: measures time; `make test` runs it after the parallel part, with "
                   "nothing else running (-m alone)")
    if hasattr(config, "workerinput"):
        # a pytest-xdist worker ignores SIGINT (its controller handles Ctrl-C); the tests
        # of Ctrl-C need Python's own handler, which raises KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(trylast=True)                  # after -m / -k / --deselect have had their say
def pytest_collection_modifyitems(config, items):
    needing = sorted({
        item.path.name if item.path.suffix == ".ipynb" else item.nodeid
        for item in items
        if item.get_closest_marker("wikitext2")
        or (item.path.suffix == ".ipynb" and notebook_needs_wikitext(item.path))
    })
    if not needing or (problem := wikitext_problem()) is None:
        return
    from pipeline_lib.lm.data import default_cache_dir

    pytest.exit(
        "\n\nWikiText-2 is needed by " + ", ".join(needing) + ",\n"
        f"and it could not be found or downloaded:\n    {problem}\n\n"
        "Either point PIPELINE_LIB_DATA at a folder holding train.txt, valid.txt and test.txt:\n"
        "    PIPELINE_LIB_DATA=/path/to/wikitext-2 make test\n"
        f"or run once with network access: it downloads about 12 MB into {default_cache_dir()}.\n"
        "The unit tests alone run without it: "
        ".venv/bin/python -m pytest tests -m 'not wikitext2'\n",
        returncode=pytest.ExitCode.USAGE_ERROR,
    )


def fails(name: str, check, *answer, says: str = "") -> str:
    """``check(*answer)`` fails inside ``exercise(name)``, with a message that starts with
    the exercise's name (what a learner sees) and contains ``says``; returns it."""
    from pipeline_lib.course.exercises import ExerciseFailed, exercise

    with pytest.raises(ExerciseFailed) as failure:
        with exercise(name):
            check(*answer)
    message = str(failure.value)
    assert message.startswith(name + ": ") and says in message, message
    return message


def passes(name: str, check, *answer) -> None:
    """``check(*answer)`` passes inside ``exercise(name)``."""
    from pipeline_lib.course.exercises import exercise

    with exercise(name):
        check(*answer)


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A one-process gloo job in this process: enough for a `DistributedPipe` whose one
    rank holds every stage (both of a V schedule's), and for `run_state` on it."""
    import socket

    import torch.distributed as dist

    from pipeline_lib.distributed import init_mesh
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield init_mesh(1, 1, 30)
    finally:
        dist.destroy_process_group()
