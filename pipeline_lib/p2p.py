"""Moving activations and gradients between pipeline ranks, one message at a time.

`pipeline_lib.distributed` explains why the transport looks the way it does (one process
group per direction, receives in the sender's order, sends never waited on early). This
module is the mechanism:

* A `Message` names what travels: the activation a stage's forward consumes, or the
  gradient its backward consumes, for one micro-batch.
* `send_order` reads a rank's program and lists what it sends to each peer, in order.
  Sender and receiver both call it: that is how the receiver knows the order to receive in.
* On the wire a message is a fixed-size header (which message; dtype and shape of each
  tensor) followed by its tensors. The receiver reads the header, checks that it is the
  message it expected, allocates exactly what the header describes and receives into it:
  shapes may change from micro-batch to micro-batch (an uneven split, a short last batch),
  and a message out of place is an error at once, never a buffer filled with garbage.
  The price, on NCCL: the header is a GPU tensor, and reading it waits for the GPU.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .mesh import Mesh
from .schedules import Schedule

HEADER_SLOTS = 64
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
MessageKind = Literal["activation", "gradient"]
KINDS: tuple[MessageKind, ...] = ("activation", "gradient")


class ProtocolError(RuntimeError):
    """The ranks disagree about what is sent when: they are not running the same program."""


@dataclass(frozen=True)
class Message:
    """The input of one action: ``stage`` is the stage that consumes it."""

    kind: MessageKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"the {self.kind} for stage {self.stage}, micro-batch {self.microbatch}"


def send_order(schedule: Schedule, rank: int) -> list[tuple[int, Message]]:
    """``(destination rank, message)`` for everything ``rank`` sends in one step, in the
    order its program produces them: a forward sends its output to the next stage, a
    backward (B or I) sends its input gradient to the previous stage."""
    last = schedule.stages - 1
    sent = []
    for action in schedule.actions[rank]:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s < last:
            sent.append((schedule.rank_of(s + 1), Message("activation", s + 1, i)))
        elif action.kind in ("B", "I") and s > 0:
            sent.append((schedule.rank_of(s - 1), Message("gradient", s - 1, i)))
    return sent


def describe(value: Any) -> str:
    """``float32[4, 16]``, or a tuple of those: what a message carries, for errors."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


# -- the header ------------------------------------------------------------------------

def _pack(message: Message, value: Any) -> tuple[Tensor, list[Tensor]]:
    """Header ``[kind, stage, micro-batch, is_tuple, items, (present, dtype, ndim,
    *shape) per item]`` and the tensors to send after it. Items of a tuple may be None
    (a gradient for an input that needs none)."""
    items = list(value) if isinstance(value, tuple) else [value]
    fields = [KINDS.index(message.kind), message.stage, message.microbatch,
              int(isinstance(value, tuple)), len(items)]
    tensors = []
    for item in items:
        if item is None:
            fields.append(0)
            continue
        if not isinstance(item, Tensor) or item.dtype not in DTYPES:
            raise TypeError(f"cannot send {describe(value)} as {message}: only tensors of "
                            f"dtypes {[str(d) for d in DTYPES]} (or tuples of them) can "
                            f"cross a process boundary")
        fields += [1, DTYPES.index(item.dtype), item.dim(), *item.shape]
        tensors.append(item.contiguous())
    if len(fields) > HEADER_SLOTS:
        raise ValueError(f"{message} ({describe(value)}) needs a {len(fields)}-slot header, "
                         f"more than p2p.HEADER_SLOTS = {HEADER_SLOTS}: send fewer tensors "
                         f"or tensors of fewer dimensions across stage boundaries")
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[:len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header, tensors


def _unpack(header: list[int]) -> tuple[Message, bool, list[tuple[torch.dtype, list[int]] | None]]:
    """The message, whether it is a tuple, and ``(dtype, shape)`` or None per item."""
    fields = iter(header)
    kind, stage, microbatch, is_tuple, count = (next(fields) for _ in range(5))
    specs: list[tuple[torch.dtype, list[int]] | None] = []
    for _ in range(count):
        if next(fields):
            dtype, ndim = DTYPES[next(fields)], next(fields)
            specs.append((dtype, [next(fields) for _ in range(ndim)]))
        else:
            specs.append(None)
    return Message(KINDS[kind], stage, microbatch), bool(is_tuple), specs


# -- the transport ---------------------------------------------------------------------

@dataclass
class _Inbox:
    """What one peer sends this rank: its order for a whole step, what is still to come
    this step, and what arrived before it was needed."""

    peer: int                      # the sender's global rank
    group: dist.ProcessGroup       # carries only this peer's messages to this rank
    order: list[Message]
    pending: deque[Message]
    early: dict[Message, Any]


class Transport:
    """This rank's sends and receives for one pipeline replica of a `Mesh`.

    Ranks are pipeline ranks (0 .. pp-1) here; messages between two stages on the same
    rank (pp = 1) are handed over in memory.
    """

    def __init__(self, mesh: Mesh, schedule: Schedule):
        self.mesh = mesh
        self.timeout = timedelta(seconds=mesh.timeout)
        me = mesh.pipe_rank
        self.inboxes: dict[int, _Inbox] = {}
        for peer in range(schedule.ranks):
            order = [msg for dst, msg in send_order(schedule, peer) if dst == me]
            if peer != me and order:
                self.inboxes[peer] = _Inbox(mesh.global_rank(peer), mesh.link(peer, me),
                                            order, deque(order), {})
        self.in_memory: dict[Message, Any] = {}
        self.sending: list[tuple[dist.Work, Tensor]] = []

    def send(self, dst: int, message: Message, value: Any) -> None:
        """Start sending; never waits. The buffers are kept until `finish_step`."""
        if dst == self.mesh.pipe_rank:
            self.in_memory[message] = value
            return
        header, tensors = _pack(message, value)
        peer, group = self.mesh.global_rank(dst), self.mesh.link(self.mesh.pipe_rank, dst)
        for tensor in [header.to(self.mesh.device), *tensors]:
            self.sending.append((dist.isend(tensor, peer, group=group), tensor))

    def receive(self, src: int, message: Message) -> Any:
        """Wait for ``message`` from pipeline rank ``src``, receiving whatever that rank
        sent before it first (in its send order) and keeping it for later."""
        if src == self.mesh.pipe_rank:
            return self.in_memory.pop(message)
        inbox = self.inboxes[src]
        while message not in inbox.early:
            expected = inbox.pending.popleft()
            inbox.early[expected] = self._receive_next(inbox, expected)
        return inbox.early.pop(message)

    def _receive_next(self, inbox: _Inbox, expected: Message) -> Any:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.mesh.device)
        self._wait(dist.irecv(header, inbox.peer, group=inbox.group), inbox, expected)
        message, is_tuple, specs = _unpack(header.tolist())
        if message != expected:
            raise ProtocolError(f"rank {self.mesh.rank} expected {expected} from rank "
                                f"{inbox.peer} but received {message}: the ranks are not "
                                f"running the same schedule")
        items = [None if spec is None else
                 torch.empty(spec[1], dtype=spec[0], device=self.mesh.device)
                 for spec in specs]
        works = [dist.irecv(t, inbox.peer, group=inbox.group) for t in items if t is not None]
        for work in works:
            self._wait(work, inbox, expected)
        return tuple(items) if is_tuple else items[0]

    def _wait(self, work: dist.Work, inbox: _Inbox, message: Message) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            exc.add_note(f"rank {self.mesh.rank} was receiving {message} from rank "
                         f"{inbox.peer} (waits time out after {self.mesh.timeout:g} s)")
            raise

    def finish_step(self) -> None:
        """Wait for this step's sends; expect the same messages again next step."""
        for work, _ in self.sending:
            work.wait(self.timeout)
        self.sending.clear()
        for inbox in self.inboxes.values():
            inbox.pending.extend(inbox.order)
