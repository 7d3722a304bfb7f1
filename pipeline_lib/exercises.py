"""Checks for the notebooks' exercises, so that a failing check tells the learner what is
wrong instead of "AssertionError".

Every exercise has a solution cell (nbgrader's ``### BEGIN SOLUTION`` / ``### END
SOLUTION`` region, which ``make student`` replaces by ``raise NotImplementedError()``) and
a check cell that runs inside ``exercise(...)``::

    with exercise("Exercise 2.1 (GPipe as an action list)") as check:
        schedule = my_gpipe(3, 4)                      # the learner's code
        check(validate(schedule) is None, "the schedule breaks a dependency: ...")

Whatever goes wrong inside the block becomes one `ExerciseFailed` whose message starts
with the exercise's name: a failed ``check``, the untouched stub (``NotImplementedError``),
a solution cell that was never run (``NameError``), or any error the learner's code
raised. The name is what ``tests/test_exercises.py`` looks for: on the student version
every check must fail with its own exercise's name, on the instructor version pass.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ExerciseFailed(AssertionError):
    """An exercise's check did not pass; the message says what to change."""


Check = Callable[[bool, str], None]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


@contextmanager
def exercise(name: str) -> Iterator[Check]:
    """Run one exercise's check; print that it passed, or raise `ExerciseFailed`."""
    try:
        yield _check
    except ExerciseFailed as failed:
        raise ExerciseFailed(f"{name}: {failed}") from None
    except NotImplementedError:
        raise ExerciseFailed(f"{name}: not done yet. Replace the `raise "
                             f"NotImplementedError()` in the solution cell above with your "
                             f"code, run that cell, then this one.") from None
    except NameError as missing:
        raise ExerciseFailed(f"{name}: {missing}. Run the solution cell above first (and "
                             f"the notebook's cells before it).") from None
    except Exception as error:
        raise ExerciseFailed(f"{name}: your code raised {type(error).__name__}: {error}"
                             ) from error
    print(f"{name}: passed")
