"""Random numbers per (stage, micro-batch), independent of thread timing.

With one thread per stage, the order in which threads draw from a device's generator
would change from run to run, and a checkpointed stage could not replay its dropout
masks. So each (stage, micro-batch) draws from its own stream, seeded from (step seed,
stage, micro-batch): masks are identical across schedules, checkpoint modes, thread
timings and both executors.

A kernel that draws without being given a generator (dropout, ``torch.rand``) draws from
its device's process-wide generator: on the CPU one for the whole process, on a GPU one
per device, shared by every thread. Three mechanisms give a block its stream; all draw
what the process-wide generator seeded with the stream's seed would draw:

* `owned_rng`, where one thread runs every stage of the process (`DistributedPipe`, a
  one-rank `Pipe.step`): it seeds the process-wide generators for the block and puts
  them back after. Two state copies per (stage, micro-batch), nothing per kernel.
* `shared_rng`, where stage threads draw at once (`Pipe.step` on several ranks, and
  ``pipe(x)``, whose checkpointed stages replay on autograd's threads): only the layers
  that draw get the stream, while they run, and nothing else pays anything (a model
  without dropout, or in eval mode, nothing at all). On a GPU stage the stream's state
  is swapped into the generators under a lock, for the microseconds the host takes to
  queue the layer's kernels; on a CPU stage, where the layer computes while it runs,
  `microbatch_rng`'s dispatch mode hands the layer's random kernels the stream's
  generators, without a lock, for that layer only (a dropout: four kernels). Which
  layers draw is found the first time a stage runs (in each training mode), by
  `microbatch_rng`; a draw elsewhere since (a layer that draws only sometimes, another
  thread of the process drawing during the step) is caught when the block ends, as an
  error: its numbers would have depended on thread timing.
* `microbatch_rng`, a dispatch mode that sees every kernel (aten op) the block runs, a
  Python call each, and hands each random one the stream's generator (or, for a kernel
  that takes none, CUDA's fused dropout, the stream swapped in under the lock): exact
  whatever the block runs. `shared_rng` uses it to find the layers that draw, inside
  them on CPU stages, and for a stage that draws outside any layer (in ``loss_fn``, say),
  every time.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline_lib.devices import indexed

_LOCK = threading.Lock()   # held while a stream is swapped into a process-wide generator
_RANDOM = torch.Tag.nondeterministic_seeded
CPU = torch.device("cpu")
RandomStream = Callable[[int, torch.device, "nn.Module | None"], ContextManager[None]]


def seed_for(step_seed: int, stage: int, microbatch: int) -> int:
    """A seed that depends on nothing but these three numbers."""
    digest = hashlib.blake2b(f"{step_seed}/{stage}/{microbatch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def new_step_seed() -> int:
    """Drawn from the global generator, so `torch.manual_seed` makes steps reproducible.
    (A read of a CPU tensor: no device to wait for.) Counted, so that a step's stage
    threads can tell this draw, made by another thread's ``pipe(x)`` while they run, from
    a draw of their own (`shared_rng`)."""
    global _step_seeds
    with _LOCK:
        _step_seeds += 1
        return int(_seed(None).item())


_step_seeds = 0   # how many times `new_step_seed` has drawn in this process


def _seed(generator: torch.Generator | None) -> torch.Tensor:
    return torch.randint(0, 2**62, (), generator=generator)


def _only_step_seeds(before: torch.Tensor, seeds: int) -> bool:
    """Whether the CPU generator, at state ``before``, reaches its state now by ``seeds``
    draws of `new_step_seed` and nothing else. Call with `_LOCK` held."""
    replay = torch.Generator()
    replay.set_state(before)
    for _ in range(seeds):
        _seed(replay)
    return torch.equal(replay.get_state(), torch.default_generator.get_state())


def _process_generator(device: torch.device) -> torch.Generator:
    """What a kernel on ``device`` (indexed) draws from when it is given no generator."""
    if device.type != "cuda":
        return torch.default_generator
    torch.cuda.init()   # creates torch.cuda.default_generators
    return torch.cuda.default_generators[device.index]


class _Stream(TorchDispatchMode):
    """Sees every kernel (aten op) of the block; gives each random one its stream: a
    generator per device (the CPU and the stage's), made on the first draw there (in
    ``generators``, which may outlive the block). ``drew(device)`` is told of each draw
    that would have come from a process-wide generator."""

    def __init__(self, seed: int, device: torch.device,
                 drew: Callable[[torch.device], None] = lambda device: None,
                 generators: dict[torch.device, torch.Generator] | None = None):
        super().__init__()
        self.seed, self.devices, self.drew = seed, (CPU, device), drew
        self.generators = {} if generators is None else generators

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _RANDOM not in func.tags:
            return func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device = tensors[0].device if tensors else indexed(kwargs.get("device") or CPU)
        if device not in self.devices:
            raise RuntimeError(f"a random kernel ran on {device}, not on its stage's devices "
                               f"{sorted(set(map(str, self.devices)))}: move that layer there")
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(self.seed)
        mine, names = self.generators[device], [a.name for a in func._schema.arguments]
        if "generator" in names:
            # PyTorch drops a trailing generator=None before dispatch: absent means default
            if names.index("generator") >= len(args) and kwargs.get("generator") is None:
                kwargs = {**kwargs, "generator": mine}
                self.drew(device)
            return func(*args, **kwargs)
        self.drew(device)
        shared = _process_generator(device)
        with _LOCK:
            saved = shared.get_state()
            shared.set_state(mine.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                mine.set_state(shared.get_state())
                shared.set_state(saved)


@contextlib.contextmanager
def microbatch_rng(seed: int, device: torch.device | str = "cpu",
                   module: nn.Module | None = None) -> Iterator[None]:
    """Run the block with its own random stream on the CPU and ``device``, started from
    ``seed``. Entering twice with the same seed replays the same random numbers: that is
    how a checkpointed stage recomputes its forward with the first pass's dropout masks.
    (``module``, the stage the block runs, is not needed: every kernel is seen.)"""
    with _Stream(seed, indexed(device)):
        yield


@contextlib.contextmanager
def owned_rng(seed: int, device: torch.device | str = "cpu",
              module: nn.Module | None = None) -> Iterator[None]:
    """`microbatch_rng` for a process whose generators belong to one thread."""
    generators = [_process_generator(d) for d in {CPU, indexed(device)}]
    saved = [g.get_state() for g in generators]
    for g in generators:
        g.manual_seed(seed)
    try:
        yield
    finally:
        for g, state in zip(generators, saved):
            g.set_state(state)


# -- shared_rng: the stream swapped in by the layers that draw ---------------------------

_local = threading.local()   # .block: the `_Block` running on this thread, if any
# layer -> the devices it draws on without a generator (found by `_find_draws`)
_draws: weakref.WeakKeyDictionary[nn.Module, set[torch.device]] = weakref.WeakKeyDictionary()
# stage -> the training modes it was examined in; and the stages drawing outside a layer
_examined: weakref.WeakKeyDictionary[nn.Module, set[tuple[bool, ...]]] = \
    weakref.WeakKeyDictionary()
_outside: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _Block:
    """One (stage, micro-batch)'s stream in `shared_rng`, given to each layer that draws.

    On a GPU stage the stream's state is swapped into the process-wide generators, under
    the lock, while the layer runs: the host only queues kernels then, so the lock is
    held for microseconds. On a CPU stage the layer computes while it runs, and a lock
    held through an attention's forward would make concurrent stage threads wait for
    each other (bench/README.md): there `_Stream` hands the layer's random kernels the
    stream's generators instead, for that layer only, without a lock."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.device = seed, device
        self.generators: dict[torch.device, torch.Generator] = {}   # `_Stream`'s, on a CPU
        self.states: dict[torch.device, torch.Tensor] = {}          # swapped in, on a GPU
        self.swapped: dict[torch.device, torch.Tensor] = {}   # device -> what it displaced
        self.levels: list[Any] = []   # per layer running: the devices it swapped, or a mode

    def enter(self, devices: set[torch.device]) -> None:
        """A drawing layer starts. Layers nest (a block that draws itself and holds a
        dropout layer): from the outermost one that draws on a device to its end, the
        lock is held and the stream swapped in there (or the dispatch mode is on)."""
        if self.device.type == "cpu":
            mode = None
            if not any(self.levels):
                mode = _Stream(self.seed, self.device, generators=self.generators)
                mode.__enter__()
            self.levels.append(mode)
            return
        new = [d for d in devices if d not in self.swapped]
        if new and not self.swapped:
            _LOCK.acquire()
        for d in new:
            generator = _process_generator(d)
            self.swapped[d] = generator.get_state()
            if d in self.states:
                generator.set_state(self.states[d])
            else:
                generator.manual_seed(self.seed)
        self.levels.append(new)

    def exit(self) -> None:
        """The layer that entered last ends: what it swapped in goes back."""
        level = self.levels.pop()
        if isinstance(level, _Stream):
            level.__exit__(None, None, None)
            return
        for d in level or []:
            generator = _process_generator(d)
            self.states[d] = generator.get_state()
            generator.set_state(self.swapped.pop(d))
        if level and not self.swapped:
            _LOCK.release()


def _layer_starts(layer: nn.Module, args: Any) -> None:
    block = getattr(_local, "block", None)
    if block is not None:
        block.enter(_draws.get(layer, set()))


def _layer_ends(layer: nn.Module, args: Any, output: Any) -> None:
    block = getattr(_local, "block", None)
    if block is not None and block.levels:
        block.exit()


def _modes(stage: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in stage.modules())


def _find_draws(seed: int, device: torch.device, stage: nn.Module) -> ContextManager[None]:
    """`microbatch_rng` for one block of ``stage``, noting the innermost layer running at
    each draw from a process-wide generator; when it ends, the layers found get the
    hooks that swap a stream in (`_Block`)."""
    running: list[nn.Module] = []
    me = threading.get_ident()
    found: dict[nn.Module | None, set[torch.device]] = {}

    def push(layer: nn.Module, args: Any) -> None:
        if threading.get_ident() == me:
            running.append(layer)

    def pop(layer: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == me and running and running[-1] is layer:
            running.pop()

    def drew(on: torch.device) -> None:
        found.setdefault(running[-1] if running else None, set()).add(on)

    @contextlib.contextmanager
    def examined() -> Iterator[None]:
        handles = [h for layer in stage.modules() for h in (
            layer.register_forward_pre_hook(push),
            layer.register_forward_hook(pop, always_call=True))]
        try:
            with _Stream(seed, device, drew):
                yield
        finally:
            for handle in handles:
                handle.remove()
        for layer, devices in found.items():
            if layer is None:
                _outside.add(stage)
                continue
            if layer not in _draws:
                layer.register_forward_pre_hook(_layer_starts)
                layer.register_forward_hook(_layer_ends, always_call=True)
            _draws[layer] = _draws.get(layer, set()) | devices
        _examined.setdefault(stage, set()).add(_modes(stage))

    return examined()


@contextlib.contextmanager
def shared_rng(seed: int, device: torch.device | str = "cpu",
               module: nn.Module | None = None) -> Iterator[None]:
    """`microbatch_rng`'s numbers for stage ``module``'s block, where other stage threads
    draw at the same time, without a Python call per kernel (see the module docstring).
    Without ``module``, it is `microbatch_rng`."""
    device = indexed(device)
    if module is None or module in _outside:
        with microbatch_rng(seed, device):
            yield
        return
    if _modes(module) not in _examined.get(module, ()):
        with _find_draws(seed, device, module):
            yield
        return
    generators = {d: _process_generator(d) for d in (CPU, device)}
    with _LOCK:
        before = {d: g.get_state() for d, g in generators.items()}
        seeds = _step_seeds
    previous, _local.block = getattr(_local, "block", None), _Block(seed, device)
    try:
        yield
    finally:
        _local.block = previous
    with _LOCK:
        moved = [str(d) for d, g in generators.items() if not torch.equal(g.get_state(), before[d])
                 and not (d == CPU and _only_step_seeds(before[d], _step_seeds - seeds))]
    if moved:
        _examined.pop(module, None)   # examine the stage again at its next block
        raise RuntimeError(
            f"random numbers were drawn from the generator of {', '.join(moved)} that stage "
            f"threads share, outside the layers of this stage found drawing when it first "
            f"ran ({[type(layer).__name__ for layer in module.modules() if layer in _draws]}): "
            f"such numbers depend on thread timing, and a checkpointed replay would draw "
            f"others. A layer that draws only sometimes (a dropout probability raised from "
            f"0, a branch on the data) or another thread of this process drawing during "
            f"the step does this. The stage is examined again at its next step; a draw "
            f"that depends on the data needs a generator passed explicitly "
            f"(torch.rand(..., generator=g))")


def streams_for(threads: int) -> RandomStream:
    """The cheaper mechanism that keeps the streams apart when ``threads`` stage threads
    draw at the same time: `owned_rng` for one (no other thread of the pipeline draws
    while it holds the process-wide generators; a thread of the caller's own that draws
    random numbers during a step would, and would then shift the step's masks),
    `shared_rng` for several."""
    return owned_rng if threads == 1 else shared_rng
