"""The executor loop: what a rank does with its lowered program, whichever way tensors
travel.

A rank's program is its list of `lowering.Step`s: a compute action, the messages it
receives right before and those it sends right after (`lowering.lower` derives them from
the schedule and the skip routes, once). For each step, `run_program` receives, has the
stage's `StageRunner` compute, and sends. Both executors run this very loop; they differ
only in their `Transport`, which moves keyed messages (`lowering.Message`):

* `threaded.threads.InProcess`: mailboxes shared by the stage threads of one process;
* `distributed.p2p.PointToPoint`: ``torch.distributed`` sends and receives.

A message between two stages of one rank (``local``) never reaches the transport: the
loop hands it over in memory.

What surrounds the loop in a training step (splitting the batch, the loss weights,
setting ``.grad`` aside and committing it) is shared too: `pipeline_lib.step`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping, Protocol, Sequence

import torch

from pipeline_lib.devices import transfer
from pipeline_lib.lowering import Message, Receive, Send, Step
from pipeline_lib.schedules import Action
from pipeline_lib.skip import SkipError, SkipKey, describe
from pipeline_lib.timeline import Event


class Transport(Protocol):
    """How one rank's messages reach the ranks that consume them."""

    where: str   # the rank, for errors: "pipeline rank 1 (cuda:1)"

    def check(self) -> None:
        """Raise if the pipeline has failed elsewhere: called before every action, so
        that a rank stops there, whatever comes next."""

    def receive(self, peer: int, message: Message) -> Any:
        """Wait for ``message`` from rank ``peer``."""

    def send(self, peer: int, message: Message, value: Any) -> None:
        """Hand ``value`` to rank ``peer`` as ``message``. Never waits for the receiver."""

    def input_note(self, receive: Receive, value: Any) -> str | None:
        """What to say about a forward's received input when the forward fails."""


class Stopwatch:
    """When each action of one rank ran, as `Event`s on ``clock`` (seconds, shared with
    the other ranks).

    On the CPU an action's time is read from the clock around its compute. On CUDA,
    kernels are only queued when the host returns, so events are recorded on the stream
    instead and read once, at the end of the step (`events`): the timeline shows when
    the device worked, with no host synchronisation per action.
    """

    def __init__(self, rank: int, device: torch.device, clock: Callable[[], float]):
        self.rank, self.clock, self.device = rank, clock, device
        self.cuda = device.type == "cuda"
        self._events: list[Event] = []
        self._marks: list[tuple[Action, Any, Any]] = []
        if self.cuda:   # the stream's zero, on the shared clock
            self._zero = self._record()
            self._zero.synchronize()
            self._zero_s = clock()

    def _record(self) -> Any:
        """An event recorded now on the device's current stream (the one the rank's
        kernels go to), whichever device is current on this thread."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def timing(self, action: Action) -> Iterator[None]:
        if not self.cuda:
            start = self.clock()
            yield
            self._events.append(Event(self.rank, action, start, self.clock()))
            return
        start = self._record()
        yield
        self._marks.append((action, start, self._record()))

    def events(self) -> list[Event]:
        """The actions timed so far (waits for the device's queued work on CUDA)."""
        if self._marks:
            self._marks[-1][2].synchronize()
            at = lambda mark: self._zero_s + self._zero.elapsed_time(mark) / 1000  # noqa: E731
            self._events += [Event(self.rank, a, at(s), at(e)) for a, s, e in self._marks]
            self._marks.clear()
        return self._events


def perf_clock() -> Callable[[], float]:
    """Seconds since now, for the ranks of one process."""
    zero = time.perf_counter()
    return lambda: time.perf_counter() - zero


def _unarmed(action: Action) -> ContextManager[None]:
    return contextlib.nullcontext()


def run_program(program: Sequence[Step], runners: Mapping[int, Any], last: int,
                inputs: Sequence[Any], targets: Sequence[Any], transport: Transport,
                stopwatch: Stopwatch, name: str,
                around: Callable[[Action], ContextManager[None]] = _unarmed) -> None:
    """Run one rank's lowered ``program`` with ``runners[stage]`` (`StageRunner`s) of its
    stages.

    ``inputs[i]``, ``targets[i]``: micro-batch i's, for stage 0 and stage ``last``.
    ``around(action)``: a block each backward runs in (`DistributedPipe` arms DDP's
    all-reduce there). An error gets a note naming the rank and the action."""
    held: dict[Message, Any] = {}   # messages between stages of this rank
    for step in program:
        action = step.action
        s, i, runner = action.stage, action.microbatch, runners[action.stage]
        try:
            transport.check()
            x, skips = None, {}   # the input (or output gradient); skip tensors (or grads)
            for op in step.receives:   # waiting here shows as idle time
                message = op.message
                value = held.pop(message) if op.local else transport.receive(op.peer, message)
                if message.skip is None:
                    x = value
                else:
                    skips[message.skip] = value
            with stopwatch.timing(action):
                if action.kind == "F":
                    x = transfer(inputs[i], runner.device) if s == 0 else x
                    target = transfer(targets[i], runner.device) if s == last else None
                    try:
                        y = runner.forward(i, x, target, skips=skips)
                    except Exception as exc:
                        note = transport.input_note(step.receives[0], x) if s > 0 else None
                        if note:
                            exc.add_note(note)
                        raise
                    _send(step.sends, y, runner.take_stashed(i), held, transport)
                elif action.kind == "W":
                    with around(action):
                        runner.backward_weight(i)
                else:
                    backward = runner.backward if action.kind == "B" else runner.backward_input
                    with around(action):
                        grad = backward(i, x, skip_grads=skips)
                    _send(step.sends, grad, runner.take_skip_grads(i), held, transport)
        except Exception as exc:
            exc.add_note(f"raised on {transport.where} while running {action} of {name}")
            raise


def _send(sends: Sequence[Send], value: Any, skips: Mapping[SkipKey, Any],
          held: dict[Message, Any], transport: Transport) -> None:
    """Send an action's output (``value``) and its skip tensors (or their gradients)."""
    for op in sends:
        message = op.message
        if message.skip is None:
            out = value
        elif message.skip in skips:
            out = skips[message.skip]
        else:   # a forward that did not stash what its layers declare
            raise SkipError(f"stage {message.source} declares a stash of "
                            f"{describe(message.skip)} but its forward of micro-batch "
                            f"{message.microbatch} did not stash it; stage {message.stage} "
                            f"would wait for it forever")
        if op.local:
            held[message] = out
        else:
            transport.send(op.peer, message, out)
