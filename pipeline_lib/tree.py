"""Walking nested values: a tensor, or tuples, lists and dicts of them, nested.

Batches, the activations that travel between stages and their gradients may be such
trees. Every part of the library that looks inside one uses these few functions, so all
agree on what a tree is: tuples (named ones included), lists and dicts are containers,
walked in order (a dict in its key order); anything else is a leaf: a tensor, or a value
such as None, a number, a string or a `microbatch.NoChunk`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import Tensor


def _children(value: Any) -> list[Any] | None:
    """A container's items in order; None for a leaf."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (tuple, list)):
        return list(value)
    return None


def _rebuild(like: Any, children: list[Any]) -> Any:
    """A container of ``like``'s type (and keys) holding ``children``."""
    if isinstance(like, dict):
        return type(like)(zip(like.keys(), children))
    if isinstance(like, tuple) and hasattr(like, "_fields"):   # a namedtuple
        return type(like)(*children)
    return type(like)(children)


def leaves(value: Any) -> list[Any]:
    """Every leaf, in order."""
    children = _children(value)
    if children is None:
        return [value]
    return [leaf for child in children for leaf in leaves(child)]


def tensors(value: Any) -> list[Tensor]:
    """The tensor leaves, in order."""
    return [leaf for leaf in leaves(value) if isinstance(leaf, Tensor)]


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """The same structure with ``fn(leaf)`` in place of every leaf."""
    children = _children(value)
    if children is None:
        return fn(value)
    return _rebuild(value, [map_leaves(fn, child) for child in children])


def map_tensors(fn: Callable[[Tensor], Any], value: Any) -> Any:
    """The same structure with ``fn(tensor)`` in place of every tensor leaf."""
    return map_leaves(lambda leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf, value)


def unflatten(new_leaves: Iterable[Any], like: Any) -> Any:
    """``like``'s structure holding ``new_leaves`` (as many as ``like`` has leaves)."""
    it = iter(new_leaves)
    return map_leaves(lambda _: next(it), like)


def same_structure(a: Any, b: Any) -> bool:
    """Whether two trees have the same containers (types, lengths, keys and order)."""
    ca, cb = _children(a), _children(b)
    if ca is None or cb is None:
        return ca is None and cb is None
    if type(a) is not type(b) or len(ca) != len(cb):
        return False
    if isinstance(a, dict) and list(a) != list(b):
        return False
    return all(same_structure(x, y) for x, y in zip(ca, cb))
