"""Moving a pipeline's messages between processes: the `executor.Transport` of
`DistributedPipe`.

Which message goes where, and in which order each rank sends them, is decided once, by
the lowering (`lowering.LoweredSchedule`): this module only moves keyed messages
(`lowering.Message`) between pipe ranks, in two layers:

1. `PointToPoint`, the lesson. A message is a header (which message; the length of the
   pickled skeleton of a tree-shaped value; dtype and shape of each tensor), the skeleton
   if there is one, then the tensors, each sent with ``isend`` and received with
   ``irecv``, on gloo as on NCCL. The receiver reads the header, checks that it is the
   message it expected, allocates exactly what it describes and receives into that:
   shapes may change between micro-batches, and a message out of place is an error at
   once, never a buffer filled with garbage. Reading a header is a host read: on a GPU,
   the host waits for the device at every message.
2. `PostedEarly`, the speed-up. When a step's batch has the shapes of an earlier step's
   (`batch_key`), so has every message: the layouts (headers and skeletons) of every
   message were agreed in the first step with those shapes and are kept. Later steps
   send only the tensors; the receiver allocates them from the kept layout and never
   reads anything on the host, and on gloo posts its receives `AHEAD` messages early, so
   that data moves while it computes. A sender whose message's layout changed anyway
   stops with an error naming the message: it never sends what the receiver did not
   expect.

Why the protocol cannot deadlock
--------------------------------
* **Senders never wait.** A send is started and the rank moves on; its buffers are kept
  until `finish_step`. Receives are the only waits, and a rank waits only for what its
  next action needs. `lowering.validate_lowered` proved, when the pipe was built, that
  ranks that wait only for their receives run every program to its end.
* **One channel per direction.** Gloo and NCCL match a group's sends and receives by
  order, one operation after another. If rank 0's activations to rank 1 and rank 1's
  gradients to rank 0 shared a group, rank 0 could queue [send activation, receive
  gradient] while rank 1 queues [send gradient, receive activation]: each send waits for
  a receive queued behind the other's send, forever. So each ordered pair of pipe ranks
  that exchange messages has a 2-rank group of its own (`mesh.Mesh.channel`), which
  carries nothing else.
* **Receive in the sender's order.** On a channel the k-th receive gets the k-th send.
  The lowering lists each channel's messages in the order the sender sends them
  (`LoweredSchedule.channel`): a rank that needs a message receives what that peer sent
  before it first and keeps it for the action that needs it later (a schedule may
  consume messages in another order than they were sent).

On NCCL, the device adds its own ways to hang, which the design avoids as follows.

* NCCL's kernels block: a send or receive kernel spins on the GPU until its peer's
  matching kernel runs. Operations on one communicator run in order on its stream;
  kernels of *several* communicators blocked at once "might work" (NCCL's documentation,
  "Using multiple NCCL communicators concurrently") if the GPU has room for all of them
  and nothing waits for the whole device. Here each channel is its own communicator, and
  its operations are queued in the order the lowering proved safe; DDP's all-reduce runs
  on the data-parallel group's communicator, entered by every replica at the same point
  of the same program (the stage's last backward), so the replicas' waits mirror one
  another and add no cycle; the step's agreement and loss all-reduces run between steps,
  when no point-to-point operation is pending.
* Something waiting for the whole device mid-step (an allocator retry's ``cudaFree``,
  ``torch.cuda.empty_cache``, ``torch.cuda.synchronize``) waits for every queued
  receive. That is safe only if each queued receive's message would be sent even if this
  rank issued nothing more, which holds for a receive queued at the action that needs it
  (that is what `validate_lowered` checks) but not for one posted ahead. So on NCCL
  receives are queued when the host reaches the action that needs them, never earlier:
  the host runs far ahead of the device, so the receive is still queued long before the
  device needs it.
* ``CUDA_DEVICE_MAX_CONNECTIONS=1`` funnels every stream into one hardware queue, where a
  blocked receive kernel would hold back the send its peer waits for: refused with NCCL.
* NCCL has no int16 (nor anything but 8-bit, 32-bit and 64-bit integers, floats and
  bool): a message holding another dtype is refused before anything is sent.

Host reads, and waits that name their peer
------------------------------------------
On NCCL, the host never waits for a message during a step: a receive makes the current
stream wait for it (``work.wait()``), and a step of known shapes reads no header. At the
end of the step (`finish_step`), the host waits for the step's messages, at most the
mesh's timeout, and names the first one that did not come: rank, message, peer and the
action that needs it, before NCCL's watchdog (given `mesh.CHANNEL_GRACE` more) ends the
process without a word about it. On gloo the host is the device: each receive waits on
the host, at most the timeout, inside the block that names it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline_lib import tree
from pipeline_lib.distributed.job import RankLost, connection_closed
from pipeline_lib.distributed.mesh import Mesh
from pipeline_lib.lowering import LoweredSchedule, Message, Receive

HEADER_SLOTS = 64
AHEAD = 2          # messages per peer whose receives `PostedEarly` posts on gloo before use
LAYOUTS_KEPT = 16  # batch shapes whose message layouts `PostedEarly` remembers
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
# NCCL's types (nccl.h: int8, uint8, int32, uint32, int64, uint64, float16, float32, float64,
# bfloat16), bool travelling as uint8 (PyTorch's ProcessGroupNCCL): no int16
NCCL_DTYPES = tuple(d for d in DTYPES if d is not torch.int16)
KINDS = ("activation", "gradient", "skip", "skip-grad")


class ProtocolError(RuntimeError):
    """The ranks disagree about what is sent when: they are not running the same program,
    or a message changed layout where the receiver counted on the one agreed."""


def describe_tensors(value: Any) -> str:
    """``float32[4, 16]``, or a tuple of those: what a message carries, for errors."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe_tensors(v) for v in value) + ")"
    return type(value).__name__


def batch_key(*values: Any, state: object = ()) -> int:
    """A number that changes when the shapes or dtypes of a step's batch change, or the
    ``state`` its messages depend on (its ``repr``), and otherwise not: when it is an
    earlier step's, so are the layouts of every message."""
    described = describe_tensors(values) + repr(state)
    digest = hashlib.blake2b(described.encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


# -- a message's layout ------------------------------------------------------------------

class Layout(NamedTuple):
    """What a message looks like, apart from its tensors' values: the header ``(kind,
    stage, micro-batch, skip, skeleton length, tensors, (dtype, ndim, *shape) per
    tensor)`` and, for a value that is not one tensor, its skeleton: the tree with a
    `_Slot` for each tensor, pickled (None, a string, a flag travel in it)."""

    header: tuple[int, ...]
    skeleton: bytes | None


class _Slot:
    """Stands for a tensor in a skeleton."""


def encode(message: Message, value: Any, skip: int = -1,
           dtypes: Sequence[torch.dtype] = DTYPES) -> tuple[Layout, list[Tensor]]:
    """``value``'s `Layout` as ``message`` and its tensors, contiguous. ``skip``: the
    index of a skip message's route, -1 for the others. Only ``dtypes`` may travel."""
    if isinstance(value, Tensor):
        skeleton, tensors = None, [value]
    else:
        skeleton = pickle.dumps(tree.map_tensors(lambda _: _Slot(), value))
        tensors = tree.tensors(value)
    fields = [KINDS.index(message.kind), message.stage, message.microbatch, skip,
              0 if skeleton is None else len(skeleton), len(tensors)]
    for t in tensors:
        if t.dtype not in dtypes:
            refused = " (NCCL has no such type)" if t.dtype in DTYPES else ""
            raise TypeError(f"cannot send {describe_tensors(value)} as {message}: a "
                            f"{t.dtype} tensor{refused}; tensors of dtypes "
                            f"{[str(d) for d in dtypes]} (in a tree of tuples, lists and "
                            f"dicts) cross a process boundary. Cast it in the stage "
                            f"(e.g. .to(torch.int32)) and back in the next one")
        fields += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(fields) > HEADER_SLOTS:
        raise ValueError(f"{message} ({describe_tensors(value)}) needs a {len(fields)}-slot "
                         f"header, more than p2p.HEADER_SLOTS = {HEADER_SLOTS}: send fewer "
                         f"tensors or tensors of fewer dimensions across stage boundaries")
    return Layout(tuple(fields), skeleton), [t.contiguous() for t in tensors]


def header_tensor(layout: Layout, device: torch.device | str = "cpu") -> Tensor:
    """The header as it travels: `HEADER_SLOTS` int64s (a copy from the host)."""
    return torch.tensor(layout.header + (0,) * (HEADER_SLOTS - len(layout.header)),
                        dtype=torch.int64, device=device)


def _specs(header: Sequence[int]) -> list[tuple[torch.dtype, list[int]]]:
    """Each tensor's dtype and shape."""
    specs, k = [], 6
    for _ in range(header[5]):
        ndim = header[k + 1]
        specs.append((DTYPES[header[k]], list(header[k + 2:k + 2 + ndim])))
        k += 2 + ndim
    return specs


def _decoded(fields: list[int]) -> tuple[int, ...]:
    """The header a padded one holds."""
    k = 6
    for _ in range(fields[5]):
        k += 2 + fields[k + 1]
    return tuple(fields[:k])


def _rebuild(skeleton: bytes | None, tensors: list[Tensor]) -> Any:
    if skeleton is None:
        return tensors[0]
    it = iter(tensors)
    return tree.map_leaves(lambda leaf: next(it) if isinstance(leaf, _Slot) else leaf,
                           pickle.loads(skeleton))


def _described(layout: Layout) -> str:
    """`describe_tensors` of the value a layout announces."""
    tensors = [torch.empty(shape, dtype=dtype, device="meta")
               for dtype, shape in _specs(layout.header)]
    return describe_tensors(_rebuild(layout.skeleton, tensors))


# -- layer 1: a header, then the tensors -----------------------------------------------

class PointToPoint:
    """This rank's sends and receives of ``lowered``'s messages in one pipeline replica of
    ``mesh`` (``peer``: a pipe rank). Messages between stages of one rank never come here
    (`executor.run_program` hands them over)."""

    def __init__(self, mesh: Mesh, lowered: LoweredSchedule):
        self.mesh, me = mesh, mesh.pipe_rank
        self.where = f"rank {mesh.rank} (replica {mesh.replica}, pipe rank {me})"
        self.nccl = dist.get_backend() == "nccl"
        if self.nccl and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise ValueError("CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream in one "
                             "hardware queue, where a receive waiting for its peer would "
                             "hold back the sends queued behind it, and two ranks could "
                             "wait for each other forever; unset it (or set it above 1) "
                             "for DistributedPipe on NCCL")
        self.dtypes = NCCL_DTYPES if self.nccl else DTYPES
        self.timeout = timedelta(seconds=mesh.timeout)
        orders = {peer: lowered.channel(peer, me) for peer in range(lowered.ranks)}
        self.orders = {peer: order for peer, order in orders.items() if order}
        self.needed_by = {r.message: step.action for step in lowered.programs[me]
                          for r in step.receives}
        self.skip_index = {route.key: k for k, route in enumerate(lowered.routes)}
        self.routes = lowered.routes
        self.pending: dict[int, deque[Message]] = {}   # per peer: still to come this step
        self.arrived: dict[Message, Any] = {}          # received before it was needed
        self.sending: list[tuple[dist.Work, Tensor, int, Message]] = []
        self.receiving: list[tuple[dist.Work, int, Message]] = []   # NCCL: not yet waited

    def check(self) -> None:
        """Nothing to check: a failed rank ends its process, and its peers' waits fail."""

    def start_step(self, key: int) -> None:
        """Expect every peer's messages of a step. ``key`` is `batch_key` of the step's
        batch, the same on every rank; only `PostedEarly` needs it."""
        self.pending = {peer: deque(order) for peer, order in self.orders.items()}

    # -- sending ------------------------------------------------------------------------

    def send(self, peer: int, message: Message, value: Any) -> None:
        """Start sending; never waits. The buffers are kept until `finish_step`."""
        skip = -1 if message.skip is None else self.skip_index[message.skip]
        layout, tensors = encode(message, value, skip, self.dtypes)
        dst, group = self.mesh.global_rank(peer), self.mesh.channel(self.mesh.pipe_rank, peer)
        for buffer in self._announced(message, layout) + tensors:
            self.sending.append((dist.isend(buffer, dst, group=group), buffer, peer, message))

    def _announced(self, message: Message, layout: Layout) -> list[Tensor]:
        """What goes before the tensors: the header, and the skeleton of a tree."""
        header = header_tensor(layout, self.mesh.device)
        if layout.skeleton is None:
            return [header]
        return [header, torch.frombuffer(bytearray(layout.skeleton), dtype=torch.uint8
                                         ).to(self.mesh.device)]

    # -- receiving ------------------------------------------------------------------------

    def receive(self, peer: int, message: Message) -> Any:
        """Wait for ``message`` from pipe rank ``peer``, receiving whatever that rank sent
        before it first (in its send order) and keeping it for later."""
        pending = self.pending[peer]
        while message not in self.arrived:
            expected = pending.popleft()
            self.arrived[expected] = self._receive_next(peer, expected)
        return self.arrived.pop(message)

    def _receive_next(self, src: int, expected: Message) -> Any:
        device = self.mesh.device
        with self._receiving(src, expected):
            [padded] = self._received(src, expected, [torch.empty(HEADER_SLOTS,
                                                                  dtype=torch.int64,
                                                                  device=device)])
            header = _decoded(padded.tolist())   # a host read: the sizes to allocate
            if header[:4] != self._identity(expected):
                raise ProtocolError(
                    f"rank {self.mesh.rank} expected {expected} from rank "
                    f"{self.mesh.global_rank(src)} but received {self._message(header)}: "
                    f"the ranks are not running the same schedule")
            skeleton = None
            if header[4]:
                [raw] = self._received(src, expected, [torch.empty(header[4],
                                                                   dtype=torch.uint8,
                                                                   device=device)])
                skeleton = bytes(raw.tolist())
            tensors = self._received(src, expected, [torch.empty(shape, dtype=dtype,
                                                                 device=device)
                                                     for dtype, shape in _specs(header)],
                                     on_host=False)
        self._learned(expected, Layout(header, skeleton))
        return _rebuild(skeleton, tensors)

    def _identity(self, message: Message) -> tuple[int, ...]:
        skip = -1 if message.skip is None else self.skip_index[message.skip]
        return KINDS.index(message.kind), message.stage, message.microbatch, skip

    def _message(self, header: tuple[int, ...]) -> Message:
        """The message a header names (its source only for errors: unknown here)."""
        kind, stage, microbatch, skip = header[:4]
        return Message(KINDS[kind], stage, microbatch, -1,
                       self.routes[skip].key if 0 <= skip < len(self.routes) else None)

    def _learned(self, message: Message, layout: Layout) -> None:
        """Called with the layout of every message received with its header."""

    def _received(self, src: int, message: Message, buffers: list[Tensor],
                  on_host: bool = True) -> list[Tensor]:
        """``buffers`` received from pipe rank ``src``, in order, as (part of) ``message``.
        The host waits for them if ``on_host`` or on gloo; otherwise (NCCL) only the
        current stream does, and the host at the end of the step (`finish_step`)."""
        peer, group = self.mesh.global_rank(src), self.mesh.channel(src, self.mesh.pipe_rank)
        works = [dist.irecv(buffer, peer, group=group) for buffer in buffers]
        self._wait(works, src, message, on_host)
        return buffers

    def _wait(self, works: Sequence[dist.Work], src: int, message: Message,
              on_host: bool) -> None:
        if self.nccl and not on_host:
            for work in works:
                work.wait()   # the current stream waits; the host goes on
            self.receiving += [(work, src, message) for work in works]
        else:
            self._wait_on_host(works)

    def _wait_on_host(self, works: Sequence[dist.Work], deadline: float | None = None) -> None:
        """Wait on the host until ``works`` are done, at most the mesh's timeout (or until
        ``deadline``, a `time.monotonic` time, on NCCL). On NCCL by asking whether they
        are done, which waits for nothing: ``work.wait(timeout)`` there would wait
        forever on a kernel that never ends."""
        if not self.nccl:
            for work in works:
                work.wait(self.timeout)
            return
        deadline = deadline or time.monotonic() + self.mesh.timeout
        for work in works:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out after {self.mesh.timeout:g} s")
                time.sleep(0.0002)

    def _receiving(self, src: int, message: Message) -> ContextManager[None]:
        """Say what this rank was waiting for, from whom and for which action, when a wait
        fails."""
        peer = self.mesh.global_rank(src)
        return self._naming(peer, lambda: f"rank {self.mesh.rank} was receiving {message} "
                                          f"from rank {peer}, which "
                                          f"{self.needed_by[message]} needs")

    def _sending(self, dst: int, message: Message) -> ContextManager[None]:
        peer = self.mesh.global_rank(dst)
        return self._naming(peer, lambda: f"rank {self.mesh.rank} was sending {message} to "
                                          f"rank {peer}")

    @contextlib.contextmanager
    def _naming(self, peer: int, doing: Callable[[], str]) -> Iterator[None]:
        try:
            yield
        except ProtocolError:
            raise
        except RuntimeError as exc:
            if connection_closed(exc):
                raise RankLost(peer, doing()) from exc
            exc.add_note(f"{doing()} (waits time out after {self.mesh.timeout:g} s)")
            raise

    def input_note(self, receive: Receive, value: Any) -> str:
        message = receive.message
        return (f"stage {message.stage}'s input for micro-batch {message.microbatch}, from "
                f"stage {message.source} on pipe rank {receive.peer}, was "
                f"{describe_tensors(value)}")

    def finish_step(self) -> None:
        """Wait on the host until this step's messages have gone (and, on NCCL, arrived),
        naming the first that did not within the timeout."""
        deadline = time.monotonic() + self.mesh.timeout
        for work, _, peer, message in self.sending:
            with self._sending(peer, message):
                self._wait_on_host([work], deadline)
        for work, peer, message in self.receiving:
            with self._receiving(peer, message):
                self._wait_on_host([work], deadline)
        self.sending.clear()
        self.receiving.clear()


# -- layer 2: layouts agreed once, receives posted early -----------------------------------

class PostedEarly(PointToPoint):
    """`PointToPoint`, sending only the tensors of a message once its layout is known
    from an earlier step with the same `batch_key`, receives posted before they are
    needed on gloo (see the module docstring)."""

    def __init__(self, mesh: Mesh, lowered: LoweredSchedule):
        super().__init__(mesh, lowered)
        self.ahead = 0 if self.nccl else AHEAD   # NCCL: see "Why the protocol ..."
        self.layouts: dict[int, dict[Message, Layout]] = {}   # per batch key, latest last
        self.learning: dict[Message, Layout] = {}              # this step's, if new
        self.known: dict[Message, Layout] | None = None        # this step's, if known
        self.key: int | None = None
        self.unposted: dict[int, deque[Message]] = {}
        self.posted: dict[int, deque[tuple[Message, list[Tensor], list[dist.Work]]]] = {}

    def start_step(self, key: int) -> None:
        """Every rank gets the same ``key`` and has seen the same steps, so every rank
        decides the same."""
        super().start_step(key)
        self.key, self.learning = key, {}
        self.known = self.layouts.pop(key, None)
        if self.known is None:
            return
        self.layouts[key] = self.known   # the latest last
        for peer, order in self.orders.items():
            self.unposted[peer], self.posted[peer] = deque(order), deque()
            self._post(peer, self.ahead)

    def _announced(self, message: Message, layout: Layout) -> list[Tensor]:
        if self.known is None:
            self.learning[message] = layout
            return super()._announced(message, layout)
        if layout != self.known[message]:
            raise ProtocolError(
                f"rank {self.mesh.rank}: {message} is {_described(layout)} in this step but "
                f"was {_described(self.known[message])} in the last one with a batch of "
                f"these shapes. With post_early=True, a message's layout (its tensors' "
                f"shapes and dtypes, and any value in it that is not a tensor) is agreed "
                f"in the first step with a batch of given shapes, and later steps send "
                f"only the tensors; a stage whose output depends on its input's values "
                f"(not only on its shape) needs DistributedPipe(..., post_early=False), "
                f"which sends every message's layout first")
        return []

    def _learned(self, message: Message, layout: Layout) -> None:
        self.learning[message] = layout

    def _receive_next(self, src: int, expected: Message) -> Any:
        if self.known is None:
            return super()._receive_next(src, expected)
        self._post(src, 1)
        message, buffers, works = self.posted[src].popleft()
        with self._receiving(src, expected):
            self._wait(works, src, expected, on_host=False)
        self._post(src, self.ahead)
        return _rebuild(self.known[message].skeleton, buffers)

    def _post(self, peer: int, count: int) -> None:
        """Keep ``count`` of ``peer``'s next messages posted, sized by their layouts."""
        src, group = self.mesh.global_rank(peer), self.mesh.channel(peer, self.mesh.pipe_rank)
        while self.unposted[peer] and len(self.posted[peer]) < count:
            message = self.unposted[peer].popleft()
            buffers = [torch.empty(shape, dtype=dtype, device=self.mesh.device)
                       for dtype, shape in _specs(self.known[message].header)]
            works = [dist.irecv(buffer, src, group=group) for buffer in buffers]
            self.posted[peer].append((message, buffers, works))

    def finish_step(self) -> None:
        super().finish_step()
        if self.known is None:   # the step went through: its layouts are agreed
            self.layouts[self.key] = self.learning
            while len(self.layouts) > LAYOUTS_KEPT:
                del self.layouts[next(iter(self.layouts))]
