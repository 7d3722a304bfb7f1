"""What an eager framework dispatches for a model, counted on the real modules: the
operations, the FLOPs of those that multiply matrices, and the bytes each reads and
writes (`Kernels`, `Work`). On a CPU a small model's step is mostly what each operation
costs however small, and its kernels are not the fused ones a GPU framework queues
ahead, so `predict` prices what was counted here rather than the model's formulas.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from pipeline_lib.plan.model import Kernels, Work


def _tensor_bytes(values: object) -> int:
    seen = {id(t): t for t in tree_leaves(values) if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in seen.values())


class _Counter(TorchDispatchMode):
    """Counts the operations dispatched while it is on (forward and autograd's backward),
    the FLOPs of those that multiply matrices (PyTorch's own `flop_registry`, as its
    `FlopCounterMode` counts them), and the bytes each reads and writes: a view moves
    none, nor does an allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.flops, self.gemm_bytes, self.nbytes = 0, 0.0, 0.0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        flops = flop_registry.get(func._overloadpacket)
        if flops is not None:
            self.flops += flops(*args, **kwargs, out_val=out)
            self.gemm_bytes += _tensor_bytes((args, kwargs, out))
        elif not func.is_view and not func.__name__.startswith("empty"):
            self.nbytes += _tensor_bytes((args, kwargs, out))
        return out


def counted(run: Callable[[], object]) -> Work:
    """What ``run`` dispatches (`Work`)."""
    with _Counter() as counter:
        run()
    return Work(counter.ops, counter.flops, counter.gemm_bytes, counter.nbytes)


def count_kernels(model: nn.Sequential, ids: torch.Tensor, target: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Kernels:
    """What one micro-batch of ``Sequential(embedding, *blocks, head)`` (the lessons'
    `transformer_lm`) dispatches, forward and backward, counted on ``ids`` (one
    micro-batch) and ``target``: the embedding, one block, and the head with the loss.
    Each backward is counted as a step's later micro-batches run it, adding into the
    gradients that the earlier ones left (a dense embedding gradient of vocabulary ×
    hidden values, read and written again for each micro-batch), and is run once before
    for that, into gradients of its own: the model's are put back as they were."""
    embedding, block, head = model[0], model[1], model[-1]
    x = embedding(ids).detach().requires_grad_()
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None                     # counting adds into gradients of its own

    def passes(forward: Callable[[], torch.Tensor]) -> tuple[Work, Work]:
        out = forward()
        out.backward(torch.ones_like(out))           # the gradients a step accumulates into
        later: list[torch.Tensor] = []
        work = counted(lambda: later.append(forward()))
        return work, counted(lambda: later[0].backward(torch.ones_like(later[0])))

    try:
        return Kernels(block=passes(lambda: block(x)),
                       embedding=passes(lambda: embedding(ids)),
                       head=passes(lambda: loss_fn(head(x), target)), tokens=ids.numel())
    finally:
        for p, grad in saved.items():
            p.grad = grad
