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
* That costs two hand-shakes per message, both on the critical path (gloo and NCCL move a
  message only once its receive is posted). So once a step has shown every message's
  header, the next step whose batch has the same shapes sends each message as **one**
  buffer, header and tensors together, and the receiver posts its receives `AHEAD`
  messages early, at sizes it knows from the last step: the data moves while the
  receiver computes. The header still travels and is checked; a sender whose output
  changed shape anyway stops with an error naming the message, never sends a size the
  receiver did not post.
"""
from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline_lib.distributed.mesh import Mesh
from pipeline_lib.schedules import Schedule

HEADER_SLOTS = 64
ALIGN = 8    # bytes: every tensor in a one-buffer message starts on a multiple of this
AHEAD = 2    # one-buffer receives posted per peer before they are needed
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
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


def _described(header: list[int]) -> str:
    """`describe` of the value a header announces."""
    _, is_tuple, specs = _unpack(header)
    items = ["None" if spec is None else f"{str(spec[0]).removeprefix('torch.')}{spec[1]}"
             for spec in specs]
    return "(" + ", ".join(items) + ")" if is_tuple else items[0]


# -- the header ------------------------------------------------------------------------

def _pack(message: Message, value: Any) -> tuple[list[int], list[Tensor]]:
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
    return fields + [0] * (HEADER_SLOTS - len(fields)), tensors


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


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _flat_size(header: list[int]) -> int:
    """Bytes of the one-buffer form of the message this header describes."""
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in
             (spec for spec in _unpack(header)[2] if spec is not None)]
    return _padded(HEADER_SLOTS * 8) + sum(_padded(n) for n in sizes)


def _flatten(header: list[int], tensors: list[Tensor], device: torch.device) -> Tensor:
    """The header, then each tensor's bytes, in one uint8 buffer."""
    flat = torch.empty(_flat_size(header), dtype=torch.uint8, device=device)
    flat[:HEADER_SLOTS * 8].copy_(torch.tensor(header, dtype=torch.int64).view(torch.uint8))
    offset = _padded(HEADER_SLOTS * 8)
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        flat[offset:offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += _padded(nbytes)
    return flat


def _unflatten(flat: Tensor) -> tuple[list[int], list[Tensor | None]]:
    """The header, and each item as a view into ``flat``."""
    header = flat[:HEADER_SLOTS * 8].view(torch.int64).tolist()
    offset, items = _padded(HEADER_SLOTS * 8), []
    for spec in _unpack(header)[2]:
        if spec is None:
            items.append(None)
            continue
        dtype, shape = spec
        nbytes = math.prod(shape) * dtype.itemsize
        items.append(flat[offset:offset + nbytes].view(dtype).view(shape))
        offset += _padded(nbytes)
    return header, items


def batch_key(*values: Any) -> int:
    """A number that changes when the shapes or dtypes of a step's batch change (and
    otherwise not): when it is the last step's, so are the shapes of every message."""
    return int.from_bytes(hashlib.blake2b(describe(values).encode(), digest_size=7).digest(),
                          "little")


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
    headers: dict[Message, list[int]] = field(default_factory=dict)   # as last received
    unposted: deque[Message] = field(default_factory=deque)
    posted: deque[tuple[Message, Tensor, dist.Work]] = field(default_factory=deque)


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
        self.sent_headers: dict[Message, list[int]] = {}
        self.key: int | None = None    # of the last step's batch
        self.one_buffer = False        # this step: one buffer per message, posted early

    def start_step(self, key: int) -> None:
        """``key`` is `batch_key` of this step's batch, the same on every rank: the step
        reuses the last step's headers if and only if it is the last step's key."""
        self.one_buffer, self.key = key == self.key, key
        if self.one_buffer:
            for inbox in self.inboxes.values():
                inbox.unposted.extend(inbox.order)
                self._post_ahead(inbox)

    def send(self, dst: int, message: Message, value: Any) -> None:
        """Start sending; never waits. The buffers are kept until `finish_step`."""
        if dst == self.mesh.pipe_rank:
            self.in_memory[message] = value
            return
        header, tensors = _pack(message, value)
        device = self.mesh.device
        if not self.one_buffer:
            self.sent_headers[message] = header
            buffers = [torch.tensor(header, dtype=torch.int64, device=device), *tensors]
        elif header == self.sent_headers[message]:
            buffers = [_flatten(header, tensors, device)]
        else:
            raise ProtocolError(
                f"rank {self.mesh.rank}: {message} is {_described(header)} in this step but "
                f"was {_described(self.sent_headers[message])} in the last one, although the "
                f"batch's shapes are the same: a stage whose output shape depends on the "
                f"values of its input cannot send it to another process")
        peer, group = self.mesh.global_rank(dst), self.mesh.link(self.mesh.pipe_rank, dst)
        for tensor in buffers:
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
        if self.one_buffer:
            message, flat, work = inbox.posted.popleft()
            assert message == expected, (message, expected)   # both in send order
            self._wait(work, inbox, expected)
            self._post_ahead(inbox)
            header, items = _unflatten(flat)
            is_tuple = self._check(header, inbox, expected)
        else:
            received = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.mesh.device)
            self._wait(dist.irecv(received, inbox.peer, group=inbox.group), inbox, expected)
            header = inbox.headers[expected] = received.tolist()
            is_tuple = self._check(header, inbox, expected)
            items = [None if spec is None else
                     torch.empty(spec[1], dtype=spec[0], device=self.mesh.device)
                     for spec in _unpack(header)[2]]
            works = [dist.irecv(t, inbox.peer, group=inbox.group)
                     for t in items if t is not None]
            for work in works:
                self._wait(work, inbox, expected)
        return tuple(items) if is_tuple else items[0]

    def _check(self, header: list[int], inbox: _Inbox, expected: Message) -> bool:
        """Whether the message is a tuple, once its header says it is the one expected."""
        message, is_tuple, _ = _unpack(header)
        if message != expected:
            raise ProtocolError(f"rank {self.mesh.rank} expected {expected} from rank "
                                f"{inbox.peer} but received {message}: the ranks are not "
                                f"running the same schedule")
        return is_tuple

    def _post_ahead(self, inbox: _Inbox) -> None:
        """Keep `AHEAD` one-buffer receives posted, sized by the last step's headers."""
        while inbox.unposted and len(inbox.posted) < AHEAD:
            message = inbox.unposted.popleft()
            flat = torch.empty(_flat_size(inbox.headers[message]), dtype=torch.uint8,
                               device=self.mesh.device)
            inbox.posted.append((message, flat,
                                 dist.irecv(flat, inbox.peer, group=inbox.group)))

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
