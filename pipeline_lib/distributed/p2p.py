"""Moving activations and gradients between pipeline ranks: a header, then the tensors.

`pipeline_lib.distributed.pipe` explains why the transport looks the way it does (one
process group per direction, receives in the sender's order, sends never waited on
early). This module is the mechanism, in two layers:

1. `Transport`, the lesson. A message is a fixed-size header (which `Message`; dtype and
   shape of each tensor), then its tensors, each sent with a plain ``isend`` and received
   with a plain ``recv``, on gloo as on NCCL. The receiver reads the header, checks that
   it is the message it expected, allocates exactly what it describes and receives into
   that: shapes may change between micro-batches, and a message out of place is an error
   at once, never a buffer filled with garbage.
2. `PostedEarly`, a speed-up. gloo and NCCL move a message only once its receive is
   posted, so every message waits for two hand-shakes (header, then tensors) on the
   critical path. When a step's batch has the last step's shapes (`batch_key`), so has
   every message: the receiver then posts its receives `AHEAD` messages early, at the
   sizes the last step's headers showed, and the data moves while it computes. Headers
   still travel and are checked; a sender whose output changed shape anyway stops with an
   error naming the message, and never sends a size the receiver did not post.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline_lib.distributed.job import RankLost, connection_closed
from pipeline_lib.distributed.mesh import Mesh
from pipeline_lib.schedules import Schedule

HEADER_SLOTS = 64
AHEAD = 2    # messages per peer whose receives `PostedEarly` posts before they are needed
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
MessageKind = Literal["activation", "gradient"]
MESSAGE_KINDS: tuple[MessageKind, ...] = ("activation", "gradient")


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
    backward (B or I) sends its input gradient to the previous stage. Sender and receiver
    both call it: that is how the receiver knows the order to receive in."""
    last = schedule.stages - 1
    sent = []
    for action in schedule.actions[rank]:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s < last:
            sent.append((schedule.rank_of(s + 1), Message("activation", s + 1, i)))
        elif action.kind in ("B", "I") and s > 0:
            sent.append((schedule.rank_of(s - 1), Message("gradient", s - 1, i)))
    return sent


def describe_tensors(value: Any) -> str:
    """``float32[4, 16]``, or a tuple of those: what a message carries, for errors."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe_tensors(v) for v in value) + ")"
    return type(value).__name__


def batch_key(*values: Any) -> int:
    """A number that changes when the shapes or dtypes of a step's batch change (and
    otherwise not): when it is the last step's, so are the shapes of every message."""
    digest = hashlib.blake2b(describe_tensors(values).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


# -- the header ------------------------------------------------------------------------

def pack(message: Message, value: Any) -> tuple[list[int], list[Tensor]]:
    """Header ``[kind, stage, micro-batch, is_tuple, items, (present, dtype, ndim,
    *shape) per item]`` and the tensors to send after it. Items of a tuple may be None
    (a gradient for an input that needs none)."""
    items = list(value) if isinstance(value, tuple) else [value]
    fields = [MESSAGE_KINDS.index(message.kind), message.stage, message.microbatch,
              int(isinstance(value, tuple)), len(items)]
    tensors = []
    for item in items:
        if item is None:
            fields.append(0)
            continue
        if not isinstance(item, Tensor) or item.dtype not in DTYPES:
            raise TypeError(f"cannot send {describe_tensors(value)} as {message}: only tensors "
                            f"of dtypes {[str(d) for d in DTYPES]} (or tuples of them) can "
                            f"cross a process boundary")
        fields += [1, DTYPES.index(item.dtype), item.dim(), *item.shape]
        tensors.append(item.contiguous())
    if len(fields) > HEADER_SLOTS:
        raise ValueError(f"{message} ({describe_tensors(value)}) needs a {len(fields)}-slot "
                         f"header, more than p2p.HEADER_SLOTS = {HEADER_SLOTS}: send fewer "
                         f"tensors or tensors of fewer dimensions across stage boundaries")
    return fields + [0] * (HEADER_SLOTS - len(fields)), tensors


def unpack(header: list[int], device: torch.device | str
            ) -> tuple[Message, bool, list[Tensor | None]]:
    """The message, whether it is a tuple, and per item an empty tensor of its dtype and
    shape on ``device`` (None for a missing item)."""
    fields = iter(header)
    kind, stage, microbatch, is_tuple, count = (next(fields) for _ in range(5))
    items: list[Tensor | None] = []
    for _ in range(count):
        if next(fields):
            dtype, ndim = DTYPES[next(fields)], next(fields)
            items.append(torch.empty([next(fields) for _ in range(ndim)], dtype=dtype,
                                     device=device))
        else:
            items.append(None)
    return Message(MESSAGE_KINDS[kind], stage, microbatch), bool(is_tuple), items


def _value(is_tuple: bool, items: list[Tensor | None]) -> Any:
    return tuple(items) if is_tuple else items[0]


def _described(header: list[int]) -> str:
    """`describe_tensors` of the value a header announces."""
    return describe_tensors(_value(*unpack(header, "meta")[1:]))


# -- layer 1: a header, then the tensors -----------------------------------------------

class Transport:
    """This rank's sends and receives for one pipeline replica of a `Mesh`.

    Ranks are pipeline ranks (0 .. pp-1) here; messages between two stages on the same
    rank (pp = 1) are handed over in memory.
    """

    def __init__(self, mesh: Mesh, schedule: Schedule):
        self.mesh = mesh
        me = mesh.pipe_rank
        orders = {peer: [msg for dst, msg in send_order(schedule, peer) if dst == me]
                  for peer in range(schedule.ranks) if peer != me}
        self.orders = {peer: order for peer, order in orders.items() if order}
        self.pending: dict[int, deque[Message]] = {}   # per peer: still to come this step
        self.arrived: dict[Message, Any] = {}          # received before it was needed
        self.sending: list[tuple[dist.Work, Tensor]] = []
        self.timeout = timedelta(seconds=mesh.timeout)

    def start_step(self, key: int) -> None:
        """Expect every peer's messages of a step. ``key`` is `batch_key` of the step's
        batch, the same on every rank; only `PostedEarly` needs it."""
        self.pending = {peer: deque(order) for peer, order in self.orders.items()}

    def send(self, dst: int, message: Message, value: Any) -> None:
        """Start sending; never waits. The buffers are kept until `finish_step`."""
        if dst == self.mesh.pipe_rank:
            self.arrived[message] = value
            return
        header, tensors = pack(message, value)
        self._check_sent(message, header)
        peer, group = self.mesh.global_rank(dst), self.mesh.link(self.mesh.pipe_rank, dst)
        for buffer in [torch.tensor(header, device=self.mesh.device), *tensors]:
            self.sending.append((dist.isend(buffer, peer, group=group), buffer))

    def _check_sent(self, message: Message, header: list[int]) -> None:
        """Called with every header before it is sent; `PostedEarly` checks it."""

    def receive(self, src: int, message: Message) -> Any:
        """Wait for ``message`` from pipeline rank ``src``, receiving whatever that rank
        sent before it first (in its send order) and keeping it for later."""
        if src != self.mesh.pipe_rank:
            while message not in self.arrived:
                expected = self.pending[src].popleft()
                self.arrived[expected] = self._receive_next(src, expected)
        return self.arrived.pop(message)

    def _receive_next(self, src: int, expected: Message) -> Any:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.mesh.device)
        self._recv(src, expected, header)
        is_tuple, items = self._check(header.tolist(), src, expected, self.mesh.device)
        for item in items:
            if item is not None:
                self._recv(src, expected, item)
        return _value(is_tuple, items)

    def _recv(self, src: int, expected: Message, buffer: Tensor) -> None:
        with self._receiving(src, expected):
            dist.recv(buffer, self.mesh.global_rank(src),
                      group=self.mesh.link(src, self.mesh.pipe_rank))

    def _check(self, header: list[int], src: int, expected: Message,
               device: torch.device | str) -> tuple[bool, list[Tensor | None]]:
        """Whether the message is a tuple, and an empty tensor on ``device`` per item
        (None for a missing one), once the header says it is the one expected."""
        message, is_tuple, items = unpack(header, device)
        if message != expected:
            raise ProtocolError(f"rank {self.mesh.rank} expected {expected} from rank "
                                f"{self.mesh.global_rank(src)} but received {message}: the "
                                f"ranks are not running the same schedule")
        return is_tuple, items

    @contextlib.contextmanager
    def _receiving(self, src: int, expected: Message) -> Iterator[None]:
        """Say what this rank was waiting for, and from whom, when a wait fails."""
        peer = self.mesh.global_rank(src)
        try:
            yield
        except RuntimeError as exc:
            if connection_closed(exc):
                raise RankLost(peer, f"rank {self.mesh.rank} was receiving {expected} "
                                     f"from rank {peer}") from exc
            exc.add_note(f"rank {self.mesh.rank} was receiving {expected} from rank {peer} "
                         f"(waits time out after {self.mesh.timeout:g} s)")
            raise

    def finish_step(self) -> None:
        """Wait for this step's sends."""
        for work, _ in self.sending:
            work.wait(self.timeout)
        self.sending.clear()


# -- layer 2: receives posted early ----------------------------------------------------

class PostedEarly(Transport):
    """`Transport`, with receives posted before they are needed whenever a step's batch
    has the last step's shapes (see the module docstring)."""

    def __init__(self, mesh: Mesh, schedule: Schedule):
        super().__init__(mesh, schedule)
        self.headers: dict[Message, list[int]] = {}   # sent or received, as last exchanged
        self.key: int | None = None                   # of the last step's batch
        self.known = False                            # this step repeats the last's shapes
        self.unposted: dict[int, deque[Message]] = {}
        self.posted: dict[int, deque[tuple[Message, list[Tensor], list[dist.Work]]]] = {}

    def start_step(self, key: int) -> None:
        """Every rank gets the same ``key``, so every rank decides the same."""
        super().start_step(key)
        self.known, self.key = key == self.key, key
        if self.known:
            for peer, order in self.orders.items():
                self.unposted[peer], self.posted[peer] = deque(order), deque()
                self._post_ahead(peer)

    def _check_sent(self, message: Message, header: list[int]) -> None:
        if self.known and header != self.headers[message]:
            raise ProtocolError(
                f"rank {self.mesh.rank}: {message} is {_described(header)} in this step but "
                f"was {_described(self.headers[message])} in the last one, although the "
                f"batch's shapes are the same. With post_early=True, a receive is posted "
                f"before its message at the size the last step's batch of these shapes "
                f"gave; a stage whose output shape depends on its input's values (not only "
                f"on its shape) needs DistributedPipe(..., post_early=False), which reads "
                f"every message's size from its header first")
        self.headers[message] = header

    def _check(self, header: list[int], src: int, expected: Message,
               device: torch.device | str) -> tuple[bool, list[Tensor | None]]:
        self.headers[expected] = header
        return super()._check(header, src, expected, device)

    def _receive_next(self, src: int, expected: Message) -> Any:
        if not self.known:
            return super()._receive_next(src, expected)
        message, buffers, works = self.posted[src].popleft()
        assert message == expected, (message, expected)   # both in send order
        with self._receiving(src, expected):
            for work in works:
                work.wait(self.timeout)
        self._post_ahead(src)
        is_tuple, items = self._check(buffers[0].tolist(), src, expected, "meta")
        received = iter(buffers[1:])
        return _value(is_tuple, [None if item is None else next(received) for item in items])

    def _post_ahead(self, peer: int) -> None:
        """Keep `AHEAD` messages' receives posted, sized by the last step's headers."""
        src, group = self.mesh.global_rank(peer), self.mesh.link(peer, self.mesh.pipe_rank)
        while self.unposted[peer] and len(self.posted[peer]) < AHEAD:
            message = self.unposted[peer].popleft()
            header = self.headers[message]
            items = unpack(header, self.mesh.device)[2]
            buffers = [torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.mesh.device),
                       *(item for item in items if item is not None)]
            works = [dist.irecv(buffer, src, group=group) for buffer in buffers]
            self.posted[peer].append((message, buffers, works))
