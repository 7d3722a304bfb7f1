"""The executor loop: what a rank does with its program, whichever way tensors travel.

A rank's program is its list of actions (`Schedule.actions[rank]`). For each action,
`run_program` receives what the action needs from other stages, has the stage's
`StageRunner` compute, and sends what it produced on. Both executors run this very loop;
they differ only in their `Transport`:

* `threaded.threads.InProcess`: mailboxes shared by the stage threads of one process;
* `distributed.pipe.PointToPoint`: ``torch.distributed`` sends and receives (`p2p`).

What surrounds the loop in a training step (splitting the batch, the loss weights,
setting ``.grad`` aside and committing it) is shared too: `pipeline_lib.step`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator, Mapping, Protocol, Sequence

import torch

from pipeline_lib.devices import transfer
from pipeline_lib.schedules import Action
from pipeline_lib.timeline import Event

Received = tuple[Any, Mapping[Any, Any]]   # (activation or gradient, skip tensors or their grads)


class Transport(Protocol):
    """How one rank's actions get their inputs from, and hand their results to, the
    stages of other ranks (or of its own)."""

    where: str   # the rank, for errors: "pipeline rank 1 (cuda:1)"

    def receive(self, action: Action) -> Received:
        """Wait for what ``action`` consumes from other stages: a forward, its input
        (stage > 0) and the skip tensors it pops; a backward (B or I), its output's
        gradient (all but the last stage) and those of the skip tensors it stashed.
        ``(None, {})`` where nothing comes. Called before every action, so a transport
        also stops the rank here once the pipeline has failed elsewhere."""

    def send(self, action: Action, value: Any, skips: Mapping[Any, Any]) -> None:
        """Hand a forward's output (and the skip tensors it stashed) to the stages that
        consume them, or a backward's input gradient (and the popped skips' gradients)
        to the stages that produced them. Never waits for the receiver."""

    def input_note(self, action: Action, value: Any) -> str | None:
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


def run_program(program: Sequence[Action], runners: Mapping[int, Any], last: int,
                inputs: Sequence[Any], targets: Sequence[Any], transport: Transport,
                stopwatch: Stopwatch, name: str,
                around: Callable[[Action], ContextManager[None]] = _unarmed) -> None:
    """Run one rank's ``program`` with ``runners[stage]`` (`StageRunner`s) of its stages.

    ``inputs[i]``, ``targets[i]``: micro-batch i's, for stage 0 and stage ``last``.
    ``around(action)``: a block each backward runs in (`DistributedPipe` arms DDP's
    all-reduce there). An error gets a note naming the rank and the action."""
    for action in program:
        s, i, runner = action.stage, action.microbatch, runners[action.stage]
        try:
            received, side = transport.receive(action)
            with stopwatch.timing(action):   # waiting above shows as idle time
                if action.kind == "F":
                    x = transfer(inputs[i], runner.device) if s == 0 else received
                    target = transfer(targets[i], runner.device) if s == last else None
                    try:
                        y = runner.forward(i, x, target, skips=side)
                    except Exception as exc:
                        note = transport.input_note(action, x) if s > 0 else None
                        if note:
                            exc.add_note(note)
                        raise
                    if s < last:
                        transport.send(action, y, runner.take_stashed(i))
                elif action.kind == "W":
                    with around(action):
                        runner.backward_weight(i)
                else:
                    backward = runner.backward if action.kind == "B" else runner.backward_input
                    with around(action):
                        grad = backward(i, received, skip_grads=side)
                    if s > 0:
                        transport.send(action, grad, runner.take_skip_grads(i))
        except Exception as exc:
            exc.add_note(f"raised on {transport.where} while running {action} of {name}")
            raise
