"""Old keyword names kept for one release, each with a warning that names the new one.

A word should mean one thing (``ranks`` the number of ranks, ``microbatches`` the number
of micro-batches); where an old keyword meant something else under another name, calls
that still use it keep working for one release and say what to write instead.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(**new_names: str) -> Callable[[F], F]:
    """Accept ``old=`` for each ``old=new`` pair as ``new=``, with a `DeprecationWarning`
    that names the new keyword; giving both is a `TypeError`."""
    def decorate(fn: F) -> F:
        called = fn.__qualname__.removesuffix(".__init__")   # a class by its name

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in new_names.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{called}() got both {old}= and {new}=; {old}= "
                                    f"is the deprecated name of {new}=: give {new}= only")
                warnings.warn(f"{called}({old}=...) is deprecated and will be removed "
                              f"in the next release; call it with {new}=... instead",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate
