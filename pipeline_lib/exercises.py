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

Where the library has a function that *is* the answer (the planner's ``predict`` for a
memory count done by hand), the check calls the learner's code inside ``withheld(...)``:
calling that function there fails with a message instead of passing the check by copying
the very numbers it compares against.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


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


@contextmanager
def withheld(*targets: Callable[..., Any] | str, namespace: dict[str, Any] | None = None
             ) -> Iterator[None]:
    """While the block runs, calling any of ``targets`` raises `ExerciseFailed`.

    A check wraps the learner's call in it when the library already computes the answer:
    an answer that calls the library would pass without the work the exercise asks for.
    A target is a function, or the name of a module or package (``"pipeline_lib.plan"``):
    every function defined in it and its submodules. ``from module import name`` binds a
    second name to the same function, so every name bound to a withheld function is
    replaced: in every loaded ``pipeline_lib`` module, and in ``namespace`` (pass the
    notebook's ``globals()``). All are restored on exit, whatever happens in the block.
    """
    if not targets:
        raise ValueError("withheld() needs at least one function or module name")
    functions = [f for target in targets for f in _functions(target)]
    modules = [module for name, module in list(sys.modules.items())
               if module is not None and _inside(name, "pipeline_lib")]
    spaces = [vars(module) for module in modules] + ([namespace] if namespace is not None
                                                     else [])
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for names in spaces:
            for name, value in list(names.items()):
                if any(value is function for function in functions):
                    swapped.append((names, name, value))
                    names[name] = _refusal(value.__name__)
        yield
    finally:
        for names, name, value in reversed(swapped):
            names[name] = value


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _functions(target: Callable[..., Any] | str) -> list[Callable[..., Any]]:
    if isinstance(target, str):
        importlib.import_module(target)        # a package's __init__ loads its modules
        found = [value for name, module in list(sys.modules.items())
                 if module is not None and _inside(name, target)
                 for value in vars(module).values()
                 if inspect.isfunction(value) and value.__module__ == name]
        if not found:
            raise ValueError(f"withheld({target!r}): that module defines no functions")
        return found
    if not callable(target):
        raise TypeError(f"withheld() takes functions or module names, got {target!r}")
    return [target]


def _refusal(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ExerciseFailed(f"your code calls `{name}`, which computes the very answer this "
                             f"check compares yours with. Work it out without `{name}`.")
    refuse.__name__ = name
    return refuse
