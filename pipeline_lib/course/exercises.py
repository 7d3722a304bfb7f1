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
  function. A copy of its code refuses too (``types.FunctionType(f.__code__, ...)``,
  ``exec(inspect.getsource(f))``, its module's source run again): a profile function
  watches the learner's call for code equal to a withheld function's. An edited copy is
  not caught (see `withheld`). A refusal the learner's code catches and hides still fails
  the check when the block ends. Compute the expected answer *before* the block.
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

import __future__
import functools
import importlib
import inspect
import random
import secrets
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType, FunctionType
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

#: The messages of the refusals in each open `withheld` block, innermost last: a refusal
#: the learner's code caught still fails the block when it ends.
_refused: list[list[str]] = []

#: The copies each open block refuses: a code object's ``co_code`` -> the signatures
#: (`_signature`) of the withheld functions with that bytecode, each with the file the
#: function was defined in and its message.
_copies: list[dict[bytes, list[tuple[tuple, str, str]]]] = []

#: The profile functions (this thread's, new threads') found when the first block opened.
_outside: list[Any] = []


def refuse(name: str, reason: str) -> None:
    """Raise the refusal of withheld ``name`` (called by the swapped-in code objects)."""
    _fail(reason.format(name=name))


def _fail(message: str) -> None:
    for messages in _refused:
        messages.append(message)
    raise ExerciseFailed(message)


REASON = ("your code calls `{name}`, which computes the very answer this check compares "
          "yours with. Work it out without `{name}`.")
MODULE_REASON = ("your code calls `{name}`, which is withheld with the rest of its module, "
                 "`{module}`: that module computes the very answer this check compares "
                 "yours with. Work it out without it.")
COPY_NOTE = " (What ran was a copy of its code: a copy is withheld too.)"


@contextmanager
def withheld(*targets: Callable[..., Any] | type | str, reason: str = REASON,
             namespace: dict[str, Any] | None = None) -> Iterator[None]:
    """While the block runs, calling any of ``targets``, or a copy of one, raises
    `ExerciseFailed`.

    A target is a function, a class (every function defined in it or in the classes it
    derives from within its own package: creating one is refused), or the name of a
    module or package (``"pipeline_lib.plan"``: every function defined in it and its
    submodules; its classes stay usable). Decorated functions are withheld with
    everything they wrap. ``reason`` is the message, ``{name}`` the function's name; a
    function withheld with its module says so, rather than that it computes the answer
    itself. If the learner's code caught a refusal, the block still fails when it ends.

    Two mechanisms, for two routes:

    * the function object itself: its code is swapped for a refusal, so every way to
      reach the object refuses, in any thread (its name, an alias, a module attribute, a
      dict such as ``BUILDERS``, a default argument, ``__wrapped__``, another library
      function that calls it); all are restored on exit, whatever happens in the block;
    * copies of its code: while the block runs, a profile function (``sys.setprofile``,
      and ``threading.setprofile`` for the threads started in the block) refuses any call
      whose code is the function's original code object (``types.FunctionType(f.__code__,
      ...)`` made before the block) or has the same bytecode, names and constants as it,
      or as its source compiled alone with or without ``from __future__ import
      annotations`` (``exec(inspect.getsource(f))``, the module's source run again,
      whatever the copy is called). Code that another module of the program defines in
      the same words (two helpers written alike) is not a copy, and runs. Not caught: a
      copy whose code was edited (a statement changed) or that was compiled under
      another module's file name, a copy run in a thread started before the block, and
      any copy while another profiler (``cProfile``) is running. The profile function
      costs well under a microsecond per call, and only inside the block.

    ``namespace`` (the notebook's globals, whose names an earlier version swapped one by
    one) is no longer needed: it is ignored, with a `DeprecationWarning`.
    """
    if namespace is not None:
        _namespace_not_needed("withheld", stacklevel=4)
    if not targets:
        raise ValueError("withheld() needs at least one function, class or module name")
    functions = {id(f): (f, name, module) for target in targets
                 for f, name, module in _functions(target)}
    reasons = {key: reason if module is None or reason != REASON
               else MODULE_REASON.format(name="{name}", module=module)
               for key, (_, _, module) in functions.items()}
    copies: dict[bytes, list[tuple[tuple, str, str]]] = {}
    for key, (function, name, _) in functions.items():
        for signature in _signatures(function):
            copies.setdefault(signature[0], []).append(
                (signature, function.__code__.co_filename,
                 reasons[key].format(name=name) + COPY_NOTE))
    refusals: list[str] = []
    swapped: list[tuple[FunctionType, CodeType]] = []
    _refused.append(refusals)
    _watch_copies(copies)
    try:
        for key, (function, name, _) in functions.items():
            refusal = _refusal_code(function, name, reasons[key])
            swapped.append((function, function.__code__))
            function.__code__ = refusal
        yield
    finally:
        for function, code in reversed(swapped):
            function.__code__ = code
        _unwatch_copies(copies)
        _refused[:] = [n for n in _refused if n is not refusals]
    if refusals:             # refused, and the learner's code carried on regardless
        raise ExerciseFailed(refusals[0])


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


def _functions(target: Callable[..., Any] | type | str
               ) -> list[tuple[FunctionType, str, str | None]]:
    """The functions to withhold for ``target``, each with the name its refusal says and,
    for a module target, the module."""
    if isinstance(target, str):
        importlib.import_module(target)        # a package's __init__ loads its modules
        found = [value for name, module in list(sys.modules.items())
                 if module is not None and _inside(name, target)
                 for value in vars(module).values()
                 if inspect.isfunction(value) and value.__module__ == name]
        if not found:
            raise ValueError(f"withheld({target!r}): that module defines no functions")
        return [(f, value.__name__, value.__module__) for value in found
                for f in _wrapped(value)]
    if isinstance(target, type):
        package = target.__module__.split(".")[0]
        found = [getattr(value, "__func__", value) for cls in target.__mro__
                 if cls.__module__.split(".")[0] == package for value in vars(cls).values()]
        found = [f for f in found if inspect.isfunction(f)]
        if not found:
            raise ValueError(f"withheld({target.__name__}): that class defines no functions")
        return [(f, target.__name__, None) for value in found for f in _wrapped(value)]
    if not inspect.isfunction(target):
        raise TypeError(f"withheld() takes Python functions, classes or module names, got "
                        f"{target!r}")
    return [(f, target.__name__, None) for f in _wrapped(target)]


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
    ours), has as many free variables as the function has closure cells, and carries the
    function's name, file and first line."""
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
    code, original = scope["outer"]().__code__, function.__code__
    # named and placed as the function, so that `inspect.getsource` still finds its source
    # (a copy made from it inside the block is then refused like any other)
    return code.replace(co_name=original.co_name, co_qualname=original.co_qualname,
                        co_filename=original.co_filename,
                        co_firstlineno=original.co_firstlineno)


# -- copies of a withheld function's code -----------------------------------------------------

def _signature(code: CodeType) -> tuple:
    """What a copy of ``code`` keeps: its bytecode, the names it uses, its local variables
    and its constants (nested code by their own signatures); not its name, file or lines."""
    return (code.co_code, code.co_names, code.co_varnames,
            tuple(_signature(c) if isinstance(c, CodeType) else (type(c), c)
                  for c in code.co_consts))


_known: dict[CodeType, list[tuple]] = {}


def _signatures(function: FunctionType) -> list[tuple]:
    """The signatures a copy of ``function`` may have: its own code's, and its source's
    compiled alone, with and without ``from __future__ import annotations`` (which changes
    how the annotations of functions nested in it are built). None for a function whose
    code is not its own (a ``functools.wraps`` wrapper shares its code with every
    function the same decorator wraps: the function it wraps is withheld instead)."""
    code = function.__code__
    if code.co_qualname != function.__qualname__:
        return []
    if code not in _known:
        found = {_signature(code)}
        try:
            source = textwrap.dedent(inspect.getsource(function))
            for flags in (0, __future__.annotations.compiler_flag):
                module = compile(source, "<copy>", "exec", flags=flags, dont_inherit=True)
                found.update(_signature(c) for c in module.co_consts
                             if isinstance(c, CodeType) and c.co_name == code.co_name)
        except (OSError, TypeError, SyntaxError):    # no source to copy from
            pass
        _known[code] = list(found)
    return _known[code]


def _watch(frame: FrameType, event: str, arg: Any) -> None:
    """The profile function of an open block: refuses a call of a withheld function's copy."""
    if event != "call":
        return
    if not _copies:                    # a thread that outlived its block
        sys.setprofile(None)
        return
    code = frame.f_code
    if id(code) in _allowed:
        return
    for copies in _copies:
        for signature, filename, message in copies.get(code.co_code, ()):
            if signature != _signature(code):
                continue
            if code.co_filename != filename and code.co_filename in _module_files():
                _allowed[id(code)] = code  # the same lines in another module of the program
                return
            _fail(message)


#: Code objects that equal a withheld function's but are another module's own (two
#: helpers written alike): allowed while the blocks are open, kept alive so ids hold.
_allowed: dict[int, CodeType] = {}


def _module_files() -> set[str]:
    """The source files of the modules imported now."""
    return {path for module in list(sys.modules.values())
            if isinstance(path := getattr(module, "__file__", None), str)}


def _watch_copies(copies: dict[bytes, list[tuple[tuple, str, str]]]) -> None:
    if not _copies:
        _outside[:] = [sys.getprofile(), threading.getprofile()]
        _allowed.clear()
    _copies.append(copies)
    if _outside[0] is None:            # another profiler running: leave it be
        sys.setprofile(_watch)
        threading.setprofile(_watch)


def _unwatch_copies(copies: dict[bytes, list[tuple[tuple, str, str]]]) -> None:
    _copies[:] = [c for c in _copies if c is not copies]
    if not _copies and _outside[0] is None:
        sys.setprofile(None)
        threading.setprofile(_outside[1])


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
