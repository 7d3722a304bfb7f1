"""Random numbers per (stage, micro-batch), independent of thread timing.

With one thread per stage, the order in which threads draw from a device's generator
would change from run to run, and a checkpointed stage could not replay its dropout
masks. So each (stage, micro-batch) draws from its own stream, seeded from (step seed,
stage, micro-batch): masks are identical across schedules, checkpoint modes, thread
timings and both executors.

Two mechanisms give a block its stream, drawing the same numbers (`streams_for` picks):

* `owned_rng`, where one thread runs every stage (one process per rank, or a schedule
  with one rank): it seeds the process-wide generators and restores them after the
  block. It costs two state copies per (stage, micro-batch) and nothing per kernel.
* `microbatch_rng`, where stage threads draw at once: it sees every kernel the block runs
  (a dispatch mode, a Python call per aten op) and hands those PyTorch tags as random
  the stream's generator: threads draw at once, without a lock, what the process-wide
  generator would draw in the same state. A random kernel that takes no generator
  (CUDA's fused dropout, ``torch.rand``) runs with the stream swapped into the
  process-wide generator, under a lock held for that kernel only.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Callable, ContextManager, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline_lib.devices import indexed

_LOCK = threading.Lock()
_RANDOM = torch.Tag.nondeterministic_seeded
CPU = torch.device("cpu")


def seed_for(step_seed: int, stage: int, microbatch: int) -> int:
    """A seed that depends on nothing but these three numbers."""
    digest = hashlib.blake2b(f"{step_seed}/{stage}/{microbatch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def new_step_seed() -> int:
    """Drawn from the global generator, so `torch.manual_seed` makes steps reproducible."""
    return int(torch.randint(0, 2**62, ()).item())


def _process_generator(device: torch.device) -> torch.Generator:
    """What a kernel on ``device`` (indexed) draws from when it is given no generator."""
    if device.type != "cuda":
        return torch.default_generator
    torch.cuda.init()   # creates torch.cuda.default_generators
    return torch.cuda.default_generators[device.index]


class _Stream(TorchDispatchMode):
    """Sees every kernel (aten op) of the block; gives each random one its stream: a
    generator per device (the CPU and the stage's), made on the first draw there."""

    def __init__(self, seed: int, device: torch.device):
        super().__init__()
        self.seed, self.devices = seed, (CPU, device)
        self.generators: dict[torch.device, torch.Generator] = {}

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
            return func(*args, **kwargs)
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
def microbatch_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block with its own random stream on the CPU and ``device``, started from
    ``seed``. Entering twice with the same seed replays the same random numbers: that is
    how a checkpointed stage recomputes its forward with the first pass's dropout masks."""
    with _Stream(seed, indexed(device)):
        yield


@contextlib.contextmanager
def owned_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
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


def streams_for(threads: int) -> Callable[[int, torch.device], ContextManager[None]]:
    """The cheaper mechanism that keeps the streams apart when ``threads`` stage threads
    draw at the same time: `owned_rng` for one (no other thread of the pipeline draws
    while it holds the process-wide generators; a thread of the caller's own that draws
    random numbers during a step would, and would then shift the step's masks),
    `microbatch_rng` for several."""
    return owned_rng if threads == 1 else microbatch_rng
