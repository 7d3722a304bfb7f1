"""Checks for the notebooks' exercises, so that a failing check tells the learner what is
wrong instead of "AssertionError", and so that only a right answer passes.

Every exercise has a solution cell (nbgrader's ``### BEGIN SOLUTION`` / ``### END
SOLUTION`` region, which ``make student`` replaces by ``raise NotImplementedError()``) and
a check cell that runs inside ``exercise(...)``::

    with exercise("Exercise 2.1 (GPipe as an action list)"):
        nb02.check_gpipe(gpipe_by_hand)

Whatever goes wrong inside the block becomes one `ExerciseFailed` whose message starts
with the exercise's name: a failed check, the untouched stub (``NotImplementedError``),
a solution cell that was never run (``NameError``), or any error the learner's code
raised. The name is what ``tests/test_exercises.py`` looks for: on the student version
every check must fail with its own exercise's name, on the instructor version pass.

A check judges the answer, not its name. Two tools, for every notebook's checks:

* `withheld` -- where the library has a function that *is* the answer (the simulator for
  a bubble worked out by hand, a builder for a schedule written by hand), the check calls
  the learner's code inside ``with withheld(simulate, ...):``. The function object itself
  is swapped for a refusal (its ``__code__``), so it refuses however the learner reached
  it: by its name, an alias, a module attribute, a dict such as ``BUILDERS``, a default
  argument captured before the check ran, ``__wrapped__``, or from another library
  function. A refusal the learner's code catches and hides still fails the check when
  the block ends. Compute the expected answer *before* the block.
* `hidden_cases` -- cases drawn afresh on every run, none equal to a case a message
  prints or a stored output shows, so that a table copied from a failure message, or
  from the notebook, fails on the next run. A message about a drawn case names its
  input and the learner's result, never the expected one; no message prints a full
  expected answer.

A typical check::

    shown = [(10, 4), (7, 3)]
    for rows, m in shown + hidden_cases(lambda rng: (rng.randint(2, 40), rng.randint(1, 9)),
                                        4, shown=shown):
        expected = split(torch.zeros(rows), m)              # before the block
        with withheld(split, gather):
            mine = split_rows(torch.zeros(rows), m)
        ...
"""
from __future__ import annotations

import functools
import importlib
import inspect
import random
import secrets
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import CodeType, FunctionType
from typing import Any, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


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


# -- withheld: the library's answer refuses to run, however it is reached ---------------------

#: The names refused in each open `withheld` block, innermost last: a refusal the
#: learner's code caught still fails the block when it ends.
_refused: list[list[str]] = []


def refuse(name: str, reason: str) -> None:
    """Raise the refusal of withheld ``name`` (called by the swapped-in code objects)."""
    for names in _refused:
        names.append(name)
    raise ExerciseFailed(reason.format(name=name))


REASON = ("your code calls `{name}`, which computes the very answer this check compares "
          "yours with. Work it out without `{name}`.")


@contextmanager
def withheld(*targets: Callable[..., Any] | type | str, reason: str = REASON,
             namespace: dict[str, Any] | None = None) -> Iterator[None]:
    """While the block runs, calling any of ``targets`` raises `ExerciseFailed`.

    A target is a function, a class (every function defined in it or in the classes it
    derives from within its own package: creating one is refused), or the name of a
    module or package (``"pipeline_lib.plan"``: every function defined in it and its
    submodules; its classes stay usable). Decorated functions are withheld with
    everything they wrap. Each function's code is swapped for a refusal, so every way to
    reach the function object refuses; all are restored on exit, whatever happens in
    the block. ``reason`` is the message, ``{name}`` the function's name. If the
    learner's code caught a refusal, the block still fails when it ends.

    ``namespace`` (the notebook's globals, whose names an earlier version swapped one by
    one) is no longer needed: it is ignored, with a `DeprecationWarning`.
    """
    if namespace is not None:
        _namespace_not_needed("withheld", stacklevel=4)
    if not targets:
        raise ValueError("withheld() needs at least one function, class or module name")
    functions = {id(f): (f, name) for target in targets for f, name in _functions(target)}
    names: list[str] = []
    swapped: list[tuple[FunctionType, CodeType]] = []
    _refused.append(names)
    try:
        for function, name in functions.values():
            refusal = _refusal_code(function, name, reason)
            swapped.append((function, function.__code__))
            function.__code__ = refusal
        yield
    finally:
        for function, code in reversed(swapped):
            function.__code__ = code
        _refused[:] = [n for n in _refused if n is not names]
    if names:              # refused, and the learner's code carried on regardless
        raise ExerciseFailed(reason.format(name=names[0]))


def _namespace_not_needed(called: str, stacklevel: int) -> None:
    warnings.warn(f"{called}(namespace=...) is no longer needed: a withheld function "
                  f"refuses under every name; drop the argument",
                  DeprecationWarning, stacklevel=stacklevel)


def ignores_namespace(position: int) -> Callable[[F], F]:
    """For a check that took the notebook's ``globals()`` as ``namespace``, argument number
    ``position`` (from 0), before `withheld` refused a function under every name: a call
    that still passes it there or by keyword runs without it, with one
    `DeprecationWarning`. A learner's notebook written by an earlier ``make student``
    (which never overwrites a learner's answers) has check cells that pass it.

    Only a dict at ``position`` is taken for the namespace (``globals()`` always is one),
    so that a check's later parameters can still be passed by position."""
    def decorate(check: F) -> F:
        @functools.wraps(check)
        def without_namespace(*args: Any, **kwargs: Any) -> Any:
            given = kwargs.pop("namespace", None) is not None
            if len(args) > position and isinstance(args[position], dict):
                args, given = args[:position] + args[position + 1:], True
            if given:
                _namespace_not_needed(check.__name__, stacklevel=3)
            return check(*args, **kwargs)
        return without_namespace  # type: ignore[return-value]
    return decorate


def _functions(target: Callable[..., Any] | type | str) -> list[tuple[FunctionType, str]]:
    """The functions to withhold for ``target``, each with the name its refusal says."""
    if isinstance(target, str):
        importlib.import_module(target)        # a package's __init__ loads its modules
        found = [value for name, module in list(sys.modules.items())
                 if module is not None and _inside(name, target)
                 for value in vars(module).values()
                 if inspect.isfunction(value) and value.__module__ == name]
        if not found:
            raise ValueError(f"withheld({target!r}): that module defines no functions")
        return [(f, value.__name__) for value in found for f in _wrapped(value)]
    if isinstance(target, type):
        package = target.__module__.split(".")[0]
        found = [getattr(value, "__func__", value) for cls in target.__mro__
                 if cls.__module__.split(".")[0] == package for value in vars(cls).values()]
        found = [f for f in found if inspect.isfunction(f)]
        if not found:
            raise ValueError(f"withheld({target.__name__}): that class defines no functions")
        return [(f, target.__name__) for value in found for f in _wrapped(value)]
    if not inspect.isfunction(target):
        raise TypeError(f"withheld() takes Python functions, classes or module names, got "
                        f"{target!r}")
    return [(f, target.__name__) for f in _wrapped(target)]


def _wrapped(function: FunctionType) -> list[FunctionType]:
    """``function`` and every function it wraps (``__wrapped__``, as functools.wraps
    records it)."""
    chain = [function]
    while inspect.isfunction(getattr(chain[-1], "__wrapped__", None)):
        chain.append(chain[-1].__wrapped__)
    return chain


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _refusal_code(function: FunctionType, name: str, reason: str) -> CodeType:
    """A code object that calls `refuse` and fits ``function``: it runs with the
    function's globals (so it finds this module through ``sys.modules``, not by a name of
    ours) and has as many free variables as the function has closure cells."""
    free = function.__code__.co_freevars
    cells = "".join(f"    {name} = None\n" for name in free)
    uses = f"        ({', '.join(free)},)\n" if free else ""
    source = (f"def outer():\n{cells}"
              f"    def refusal(*args, **kwargs):\n{uses}"
              f"        return __import__('sys').modules[{__name__!r}].refuse("
              f"{name!r}, {reason!r})\n"
              f"    return refusal\n")
    scope: dict[str, Any] = {}
    exec(compile(source, f"<withheld {function.__qualname__}>", "exec"), scope)
    code = scope["outer"]().__code__
    return code.replace(co_name=function.__code__.co_name,
                        co_qualname=function.__code__.co_qualname)


# -- hidden cases: what no message prints and no stored output shows --------------------------

def _seed() -> int:
    """A new seed on every call (tests replace it to try a check on many draws)."""
    return secrets.randbits(64)


def hidden_cases(draw: Callable[[random.Random], T], count: int,
                 shown: Iterable[T] = ()) -> list[T]:
    """``count`` distinct cases ``draw(rng)`` makes, none equal to one in ``shown``, from
    a generator seeded afresh on every call: on every run of a check, other cases.

    ``shown`` holds the cases a message or a stored output may print with their expected
    answers; a check's message about a hidden case gives its input and the learner's
    result, never the expected one. Raises `ValueError` if ``draw`` cannot make that many
    new cases (its range is too small).
    """
    rng, seen, cases = random.Random(_seed()), list(shown), []
    for _ in range(100 * count + 100):
        if len(cases) == count:
            return cases
        case = draw(rng)
        if case not in seen:
            seen.append(case)
            cases.append(case)
    if len(cases) == count:
        return cases
    raise ValueError(f"hidden_cases: drew only {len(cases)} new cases of the {count} asked "
                     f"for; widen the range `draw` draws from")
