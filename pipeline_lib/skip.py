"""Skip connections: a layer stashes a tensor, a later layer pops it.

A U-Net or a ResNet block needs a tensor from many layers back, which an
``nn.Sequential`` cannot express: each layer sees only its predecessor's output. Threading
the tensor through every layer in between would also copy it through every pipeline stage
in between. Instead a layer declares what it stashes and pops and, in its ``forward``,
yields the requests::

    @skippable(stash=["shortcut"])
    class Save(nn.Module):
        def forward(self, x):
            yield stash("shortcut", x)
            return x

    @skippable(pop=["shortcut"])
    class Add(nn.Module):
        def forward(self, x):
            shortcut = yield pop("shortcut")
            return x + shortcut

    model = nn.Sequential(Save(), nn.Linear(4, 4), Add())   # runs as is, or in a Pipe

Outside a `Pipe`, a per-thread `SkipTracker` hands stashed tensors to later pops. Inside
one, each (stage, micro-batch) forward gets its own tracker, and the executor sends each
stashed tensor straight from the stashing stage's device to the popping stage's device
(and its gradient straight back), along the `SkipRoute`s that `skip_routes` finds.

Names are global to a model, so two copies of one block would stash the same name; give
each copy its own `Namespace` with ``block.isolate(Namespace())``.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, Sequence

from torch import Tensor, nn


class SkipError(ValueError, TypeError, RuntimeError):
    """Stashes and pops that do not pair up, or a layer using an undeclared name.

    Also a `TypeError` and a `RuntimeError`: ``torch.distributed.pipeline.sync`` raised
    TypeError when stashes and pops did not pair up and RuntimeError for a bad stash or
    pop during the forward, so code written for the classic API still catches it."""


@dataclass(frozen=True)
class Namespace:
    """A scope for skip names. Each new namespace is unique; a copy (``copy.deepcopy`` of
    a model, pickling to another process) stays equal to its original."""

    label: str = field(default="", compare=False)
    uid: uuid.UUID = field(default_factory=uuid.uuid4, repr=False)

    def __repr__(self) -> str:
        return f"Namespace({self.label!r})" if self.label else f"Namespace({self.uid})"


DEFAULT_NAMESPACE = Namespace("default")

SkipKey = tuple[Namespace, str]


def describe(key: SkipKey) -> str:
    namespace, name = key
    return repr(name) if namespace == DEFAULT_NAMESPACE else f"{name!r} in {namespace}"


@dataclass(frozen=True, eq=False)
class stash:  # noqa: N801 - lower case: it reads as a verb in ``yield stash(...)``
    """``yield stash(name, tensor)``: keep ``tensor`` for the later layer that pops it.
    ``tensor`` may be None (the pop then gets None), e.g. for a block that skips nothing
    on some inputs but must still stash, since every declared name is stashed."""

    name: str
    tensor: Tensor | None

    def __post_init__(self):
        if self.tensor is not None and not isinstance(self.tensor, Tensor):
            raise TypeError(f"stash({self.name!r}, ...) needs a tensor, got "
                            f"{type(self.tensor).__name__} (or None, to pass nothing)")

    def __repr__(self) -> str:
        value = "None" if self.tensor is None else "<tensor>"
        return f"stash({self.name!r}, {value})"


@dataclass(frozen=True)
class pop:  # noqa: N801
    """``tensor = yield pop(name)``: take the tensor an earlier layer stashed."""

    name: str


class SkipTracker:
    """Where one forward's stashes go and its pops come from.

    ``arrived`` holds tensors stashed by earlier pipeline stages; a pop reads it without
    consuming, so a checkpointed forward can be replayed. Tensors stashed and popped
    within the same forward never leave ``stashed``; the rest are what the executor sends.
    """

    def __init__(self, arrived: Mapping[SkipKey, Tensor] | None = None):
        self.arrived = arrived or {}
        self.stashed: dict[SkipKey, Tensor] = {}

    def stash(self, key: SkipKey, tensor: Tensor) -> None:
        self.stashed[key] = tensor

    def pop(self, key: SkipKey) -> Tensor:
        if key in self.stashed:
            return self.stashed.pop(key)
        if key in self.arrived:
            return self.arrived[key]
        raise SkipError(f"pop({describe(key)}) found no stashed tensor: no layer that ran "
                        f"before it stashed that name")


_local = threading.local()


def current_tracker() -> SkipTracker:
    """The tracker in use on this thread: a Pipe's, or a default one for plain use (where
    a stash that no layer pops lingers until the same name is stashed again)."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextlib.contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


class Skippable(nn.Module):
    """Base of every class made by `skippable`: declared names and their namespaces."""

    stashes: tuple[str, ...] = ()
    pops: tuple[str, ...] = ()
    _namespaces: dict[str, Namespace] = {}   # replaced, never mutated, by isolate()

    def isolate(self, namespace: Namespace, only: Iterable[str] | None = None) -> Skippable:
        """Put this layer's skip names (or just ``only``) in ``namespace``; returns self."""
        declared = self.stashes + self.pops
        names = declared if only is None else tuple(only)
        unknown = sorted(set(names) - set(declared))
        if unknown:
            raise SkipError(f"{type(self).__name__} cannot isolate {unknown}: it only "
                            f"declares stash={list(self.stashes)}, pop={list(self.pops)}")
        self._namespaces = {**self._namespaces, **{name: namespace for name in names}}
        return self

    def skip_key(self, name: str) -> SkipKey:
        return self._namespaces.get(name, DEFAULT_NAMESPACE), name

    def _serve(self, requests: Generator[stash | pop, Tensor | None, Any]) -> Any:
        """Answer the stash and pop requests a generator ``forward`` yields."""
        tracker, reply, served = current_tracker(), None, set()
        while True:
            try:
                request = requests.send(reply)
            except StopIteration as done:
                self._check_served(served)
                return done.value
            if isinstance(request, stash) and request.name in self.stashes:
                tracker.stash(self.skip_key(request.name), request.tensor)
                reply = None
            elif isinstance(request, pop) and request.name in self.pops:
                reply = tracker.pop(self.skip_key(request.name))
            else:
                raise SkipError(f"{type(self).__name__}.forward yielded {request!r}, but "
                                f"it declares stash={list(self.stashes)}, "
                                f"pop={list(self.pops)}; yield only stash(name, tensor) or "
                                f"pop(name) for declared names")
            served.add(request.name)

    def _check_served(self, served: set[str]) -> None:
        """Every declared name must be stashed or popped on every call, or the layer
        that pops it would find nothing, or a stashed tensor would linger."""
        for verb, names in (("stash", self.stashes), ("pop", self.pops)):
            missing = [name for name in names if name not in served]
            if missing:
                raise SkipError(f"{type(self).__name__}.forward declares {verb}="
                                f"{list(names)} but did not {verb} {missing}; it must "
                                f"{verb} every declared name on every call (stash(name, "
                                f"None) passes nothing)")


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()
              ) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator: the module's ``forward`` may yield ``stash`` and ``pop`` requests
    for the declared names. The decorated class is a subclass, so parameters keep their
    names and the module works in a plain ``nn.Sequential`` as well as in a `Pipe`."""
    if isinstance(stash, str) or isinstance(pop, str):
        raise TypeError("stash= and pop= take lists of names, e.g. stash=['shortcut']")
    stashes, pops = tuple(stash), tuple(pop)
    both = sorted(set(stashes) & set(pops))
    if both:
        raise SkipError(f"a layer cannot both stash and pop {both}; split it in two layers")

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, not {cls!r}")
        generator_forward = cls.forward

        def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
            result = generator_forward(self, *args, **kwargs)
            if inspect.isgenerator(result):
                return self._serve(result)
            self._check_served(set())
            return result

        return type(cls.__name__, (cls, Skippable), {
            "forward": forward, "stashes": stashes, "pops": pops,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__})
    return decorate


# -- the checker ---------------------------------------------------------------------------

def verify_skips(module: nn.Sequential) -> dict[SkipKey, tuple[int, int]]:
    """Check that every skip name is stashed once and popped once, later or in the same
    layer. Returns ``{key: (stashing layer, popping layer)}`` (indices of ``module``'s
    children); raises `SkipError` listing every mismatch, with the layers involved."""
    stashed_by: dict[SkipKey, list[tuple[int, str]]] = {}
    popped_by: dict[SkipKey, list[tuple[int, str]]] = {}
    for index, (name, layer) in enumerate(module.named_children()):
        for path, sub in layer.named_modules(prefix=name):
            if isinstance(sub, Skippable):
                where = (index, f"layer {path} ({type(sub).__name__})")
                for skip in sub.stashes:
                    stashed_by.setdefault(sub.skip_key(skip), []).append(where)
                for skip in sub.pops:
                    popped_by.setdefault(sub.skip_key(skip), []).append(where)

    problems, layout = [], {}
    for key in {**stashed_by, **popped_by}:
        stashes, pops = stashed_by.get(key, []), popped_by.get(key, [])
        what = describe(key)
        if len(stashes) > 1:
            problems.append(f"{what} is stashed twice, by {_names(stashes)}; give each copy "
                            f"its own namespace: layer.isolate(Namespace())")
        if len(pops) > 1:
            problems.append(f"{what} is popped twice, by {_names(pops)}; a stashed tensor "
                            f"can be popped once (isolate copies with layer.isolate)")
        if stashes and not pops:
            problems.append(f"{what} is stashed by {_names(stashes)} but never popped; pop "
                            f"it in a later layer or remove the stash")
        if pops and not stashes:
            problems.append(f"{what} is popped by {_names(pops)} but never stashed")
        if len(stashes) == len(pops) == 1:
            (stash_at, stasher), (pop_at, popper) = stashes[0], pops[0]
            if pop_at < stash_at:
                problems.append(f"{what} is popped by {popper} before it is stashed by "
                                f"{stasher}")
            layout[key] = (stash_at, pop_at)
    if problems:
        raise SkipError("skip connections do not pair up:\n  " + "\n  ".join(problems))
    return layout


def _names(places: list[tuple[int, str]]) -> str:
    return " and ".join(name for _, name in places)


@dataclass(frozen=True)
class SkipRoute:
    """A skip connection that crosses stages: stashed on ``source``, popped on ``target``."""

    key: SkipKey
    source: int
    target: int


def skip_routes(module: nn.Sequential, stage_of_layer: Sequence[int]) -> list[SkipRoute]:
    """The verified skip connections of ``module`` that cross stage boundaries."""
    routes = []
    for key, (stash_at, pop_at) in verify_skips(module).items():
        source, target = stage_of_layer[stash_at], stage_of_layer[pop_at]
        if source != target:
            routes.append(SkipRoute(key, source, target))
    return routes
