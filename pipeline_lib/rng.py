"""Random numbers per (stage, micro-batch), independent of thread timing.

Dropout draws from the *process-wide* generator of its device. With one thread per
stage, the order in which stage threads draw would change from run to run, and a
checkpointed stage could not replay its masks (another thread may draw between "restore
state" and "recompute"). So each (stage, micro-batch) gets a private random stream,
seeded from the step's seed. While a stage thread runs inside `microbatch_rng`, every
torch function that draws random numbers (dropout, an attention with dropout, `rand`, ...)
draws from the stream: its random kernels get the stream's own generator, so stage
threads draw at the same time, with no lock, the numbers PyTorch's kernel would draw from
the process-wide generator in the same state. Masks then depend only on (step seed,
stage, micro-batch): identical across schedules, checkpoint modes, thread timings and the
threaded and multi-process executors. Kernels that take no generator (CUDA's fused
dropout and attention, factories such as `torch.rand`) swap the stream into the
process-wide generators under a lock held for that kernel only.

A process whose stages all run on one thread (a rank of the multi-process executor) needs
neither the interception of every torch call nor the lock: `owned_rng` seeds and restores
the process-wide generators instead, and draws the same numbers.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_LOCK = threading.Lock()

# Functions that draw random numbers. A function mode does not see the torch calls nested
# inside another torch function, hence multi_head_attention_forward (its attention dropout).
_ALWAYS_RANDOM = {
    F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
    F.feature_alpha_dropout, F.rrelu, F.gumbel_softmax,
    torch.bernoulli, torch.rand, torch.rand_like, torch.randn, torch.randn_like,
    torch.randint, torch.randint_like, torch.randperm, torch.normal, torch.poisson,
    torch.multinomial,
    torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.log_normal_, torch.Tensor.cauchy_,
}
# function -> name, position and default of its dropout probability, and the position of
# its ``training`` argument (None: always training). Evaluation draws nothing.
_RANDOM_IF_DROPOUT = {
    F.dropout: ("p", 1, 0.5, 2),
    F.scaled_dot_product_attention: ("dropout_p", 4, 0.0, None),
    F.multi_head_attention_forward: ("dropout_p", 10, 0.0, 13),
}


def _argument(args: tuple, kwargs: dict, name: str, position: int | None, default):
    if name in kwargs:
        return kwargs[name]
    return args[position] if position is not None and len(args) > position else default


def _draws_random(func: Callable, args: tuple, kwargs: dict) -> bool:
    if func in _ALWAYS_RANDOM:
        return True
    if func not in _RANDOM_IF_DROPOUT:
        return False
    name, position, default, training_position = _RANDOM_IF_DROPOUT[func]
    dropout_p = _argument(args, kwargs, name, position, default)
    training = _argument(args, kwargs, "training", training_position, True)
    return bool(dropout_p) and bool(training)


def seed_for(step_seed: int, stage: int, microbatch: int) -> int:
    """A seed that depends on nothing but these three numbers."""
    digest = hashlib.blake2b(f"{step_seed}/{stage}/{microbatch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def new_step_seed() -> int:
    """Drawn from the global generator, so `torch.manual_seed` makes steps reproducible."""
    return int(torch.randint(0, 2**62, ()).item())


def _cpu_dropout(args: tuple, kwargs: dict, generator: torch.Generator) -> Tensor | None:
    """A training-mode `F.dropout` of a CPU tensor, drawn from ``generator``: what
    PyTorch's CPU kernel computes (a Bernoulli(1 - p) noise tensor, scaled, multiplied
    in), with the same numbers for the same generator state, as `_SeededOps` would run it
    but without its Python call per kernel. None where the call is not that (another
    device, a tensor subclass, a tensor-valued or edge ``p``)."""
    x = _argument(args, kwargs, "input", 0, None)
    p = _argument(args, kwargs, "p", 1, 0.5)
    inplace = _argument(args, kwargs, "inplace", 3, False)
    if not (type(x) is Tensor and x.device.type == "cpu" and isinstance(p, (int, float))
            and 0 < p < 1):
        return None
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=generator).div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


@functools.cache
def _generator_slot(op: torch._ops.OpOverload) -> int | None:
    """Position of ``op``'s ``generator`` argument, None if it takes none."""
    return next((k for k, a in enumerate(op._schema.arguments) if a.name == "generator"),
                None)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """Where a kernel draws: its first tensor's device, or a factory's ``device``."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.device
    return torch.device(kwargs.get("device") or "cpu")


class _PrivateStream(TorchFunctionMode):
    """Sees every torch function the block calls; one that draws random numbers
    (`_draws_random`) runs under `_SeededOps`, which hands each of its random kernels to
    the stream."""

    def __init__(self, seed: int, device: torch.device):
        super().__init__()
        self.seed = seed
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = device if device.type == "cuda" else None
        self.cpu: torch.Generator | None = None   # made on the first random op
        self.gpu: torch.Generator | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        if self.cpu is None:
            self.cpu = torch.Generator().manual_seed(self.seed)
            if self.cuda:
                self.gpu = torch.Generator(device=self.cuda).manual_seed(self.seed)
        if func is F.dropout:   # the most common: skip the dispatch mode's cost per kernel
            out = _cpu_dropout(args, kwargs, self.cpu)
            if out is not None:
                return out
        with _SeededOps(self):
            return func(*args, **kwargs)

    def draw(self, op: torch._ops.OpOverload, args: tuple, kwargs: dict):
        """Run the random kernel ``op`` on this stream: with the stream's generator where
        it takes one (no lock: stage threads draw at the same time), else with the stream
        swapped into the process-wide generators under the lock, for this kernel only."""
        device = _device_of(args, kwargs)
        generator = (self.cpu if device.type == "cpu" else
                     self.gpu if device == self.cuda else None)
        slot = _generator_slot(op)
        if slot is not None and generator is not None:
            # PyTorch drops a trailing generator=None before dispatch: absent means default
            if slot >= len(args) and "generator" not in kwargs:
                kwargs = {**kwargs, "generator": generator}
            return op(*args, **kwargs)
        with _LOCK:
            saved_cpu = torch.get_rng_state()
            torch.set_rng_state(self.cpu.get_state())
            if self.cuda:
                saved_cuda = torch.cuda.get_rng_state(self.cuda)
                torch.cuda.set_rng_state(self.gpu.get_state(), self.cuda)
            try:
                return op(*args, **kwargs)
            finally:
                self.cpu.set_state(torch.get_rng_state())
                torch.set_rng_state(saved_cpu)
                if self.cuda:
                    self.gpu.set_state(torch.cuda.get_rng_state(self.cuda))
                    torch.cuda.set_rng_state(saved_cuda, self.cuda)


class _SeededOps(TorchDispatchMode):
    """Active inside one random torch function: sees all its kernels (aten ops), also
    those of torch functions nested in it (an attention's dropout inside
    `F.multi_head_attention_forward`), and runs the ones PyTorch tags as random on the
    stream. The others, an attention's projections included, run as they are (under
    `torch.inference_mode` a dispatch mode makes PyTorch pick another linear kernel: the
    last bit may differ)."""

    def __init__(self, stream: _PrivateStream):
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            return self.stream.draw(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def microbatch_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block with its own random stream, started from ``seed``.

    Entering twice with the same seed replays the same random numbers: that is how a
    checkpointed stage recomputes its forward with the dropout masks of the first pass.
    """
    with _PrivateStream(seed, torch.device(device)):
        yield


@contextlib.contextmanager
def owned_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """`microbatch_rng` for a process whose generators belong to one compute thread (a
    rank of `pipeline_lib.distributed`): the same random numbers, drawn from the
    process-wide generators seeded for the block and restored after it, without
    intercepting every torch call on the way."""
    device = torch.device(device)
    cuda = device if device.type == "cuda" else None
    saved_cpu = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state(cuda) if cuda else None
    torch.default_generator.manual_seed(seed)
    if cuda:
        torch.cuda.default_generators[cuda.index or 0].manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        if cuda:
            torch.cuda.set_rng_state(saved_cuda, cuda)
