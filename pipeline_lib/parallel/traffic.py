"""The bytes a run moves, counted in the run, per mesh dimension: what the planner's
communication volumes predict.

`Traffic` is a dispatch mode: while it is on, every collective and point-to-point message
this process starts goes through it (the ``c10d`` operations of ``torch.distributed``'s
calls, which DDP's reducer, FSDP and the pipeline's sends use, and the ``_c10d_functional``
ones of tensor parallelism's `DTensor`\\ s), with its process group, so each is booked
under the mesh dimension whose group carried it. It sees the calls this thread makes and
those of the autograd engine for it (DDP's all-reduce in the backward); it costs a
Python call per operation while on, so count one step, and time others.

Bytes are what this rank *sends*, as a ring algorithm does (nccl-tests'
"bus bandwidth" convention, the one `plan.costs.ring_seconds` prices), for a buffer of
``size`` bytes over ``n`` ranks:

==================  =====================  ==========================================
operation           ``size`` is            bytes this rank sends
==================  =====================  ==========================================
all-reduce          the tensor             2·(n−1)/n · size
all-gather          the gathered output    (n−1)/n · size
reduce-scatter      the input (whole)      (n−1)/n · size
broadcast           the tensor             size (the root), 0 (the others)
send                the message            size; a receive sends nothing
==================  =====================  ==========================================

The dimensions are named as `pipeline_lib.plan.Layout` names them: ``tp``, ``pp``, ``dp``
(and ``cp``, if a mesh has it); a group no dimension claims is booked under ``other``
(the seed and loss agreements every rank joins once a step).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

OTHER = "other"

# op name -> (kind, index of the tensor(s) whose bytes are ``size``)
_C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
         "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
         "allgather_into_tensor_coalesced_": ("all_gather", 0),
         "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
         "broadcast_": ("broadcast", 0), "send": ("send", 0), "recv_": ("receive", 0),
         "recv_any_source_": ("receive", 0), "alltoall_base_": ("all_to_all", 0)}
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
               "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor": "all_gather",
               "all_gather_into_tensor_coalesced": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter",
               "reduce_scatter_tensor_coalesced": "reduce_scatter",
               "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


@dataclass(frozen=True)
class Message:
    """One collective or point-to-point message this rank took part in."""

    dim: str        # the mesh dimension whose group carried it
    kind: str       # all_reduce, all_gather, reduce_scatter, broadcast, send, receive, ...
    size: int       # bytes of the buffer (see the module docstring)
    ranks: int      # the group's size
    root: bool = True   # broadcast: whether this rank sent it

    @property
    def sent(self) -> float:
        """Bytes this rank sends for it, as a ring does."""
        n = self.ranks
        share = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                 "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
                 "broadcast": float(self.root), "send": 1.0, "receive": 0.0}[self.kind]
        return share * self.size


def _bytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors of a (nested) list: the list API's
    ``all_gather(outputs, input)`` passes ``[[outputs]]``."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_bytes(v) for v in value) if isinstance(value, (list, tuple)) else 0


class Traffic(TorchDispatchMode):
    """Count the messages of the block by mesh dimension::

        with Traffic({"tp": mesh["tp"].get_group(), "dp": ddp_group}) as traffic:
            ...one step...
        traffic.sent()        # {"tp": bytes, "dp": bytes, ...}

    ``groups`` maps a dimension's name to its process group, or to several (the
    pipeline's 2-rank links are all ``pp``)."""

    def __init__(self, groups: Mapping[str, dist.ProcessGroup | Iterable[dist.ProcessGroup]]):
        super().__init__()
        # by the group's ranks: PyTorch may run a collective of a mesh dimension on an
        # equal mesh's group (its caches key meshes by their ranks), which is the same
        self.dims: dict[tuple[int, ...], str] = {}
        for dim, value in groups.items():   # (None: a dimension of size 1)
            for group in ([value] if isinstance(value, dist.ProcessGroup) else value or ()):
                if group is not None:
                    self.dims[tuple(dist.get_process_group_ranks(group))] = dim
        self.messages: list[Message] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # let the DTensor turn into collectives on plain tensors, which come back
            # here (as PyTorch's CommDebugMode does): its redistributions inside an
            # operation (loss_parallel's, a Partial gradient's) are counted too
            return NotImplemented
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return out
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name in _C10D:
            kind, index = _C10D[name]
            group = next(dist.ProcessGroup.unbox(a) for a in args
                         if isinstance(a, torch.ScriptObject)
                         and "ProcessGroup" in str(a._type()))   # type: ignore[attr-defined]
            root = kind != "broadcast" or args[2] == dist.get_rank(group)
            self._book(group, kind, _bytes(args[index]), root)
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            size = _bytes(args[0]) * (group.size() if kind == "all_gather" else 1)
            root = kind != "broadcast" or args[1] == dist.get_rank(group)
            self._book(group, kind, size, root)
        return out

    def _book(self, group: dist.ProcessGroup, kind: str, size: int, root: bool) -> None:
        dim = self.dims.get(tuple(dist.get_process_group_ranks(group)), OTHER)
        self.messages.append(Message(dim, kind, size, group.size(), root))

    def sent(self) -> dict[str, float]:
        """Bytes this rank sent, per dimension."""
        total: dict[str, float] = defaultdict(float)
        for m in self.messages:
            total[m.dim] += m.sent
        return dict(total)

    def table(self) -> dict[tuple[str, str], tuple[int, float]]:
        """(dimension, kind) -> (messages, bytes this rank sent)."""
        rows: dict[tuple[str, str], tuple[int, float]] = {}
        for m in self.messages:
            count, sent = rows.get((m.dim, m.kind), (0, 0.0))
            rows[(m.dim, m.kind)] = (count + 1, sent + m.sent)
        return rows
