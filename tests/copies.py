"""Copies of a library function's code, made the ways a learner can make them before a
check runs: the checks must refuse them as they refuse the function itself."""
from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any


def copied(function: Callable[..., Any], rename: str | None = None) -> Callable[..., Any]:
    """A copy of ``function`` (the code under its decorators): its code object in a new
    function with the same defaults, or, with ``rename``, its source run again under that
    name."""
    function = inspect.unwrap(function)
    if rename is None:
        copy = types.FunctionType(function.__code__, function.__globals__, None,
                                  function.__defaults__, function.__closure__)
        copy.__kwdefaults__ = function.__kwdefaults__
        return copy
    scope: dict[str, Any] = {}
    exec(inspect.getsource(function).replace(f"def {function.__name__}(", f"def {rename}("),
         dict(function.__globals__), scope)
    return scope[rename]
