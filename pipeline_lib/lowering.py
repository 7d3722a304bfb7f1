"""A `Schedule` lowered once into each rank's program: compute actions and the messages
they need.

A schedule says what each rank computes, in order. What travels between ranks follows
from it by one rule, written here and nowhere else (`outputs`): a forward's output goes
from stage ``s`` to ``s + 1``, a backward's (B or I) input gradient from ``s`` to
``s - 1`` (`schedules.destination`); a skip tensor (`skip.SkipRoute`) from the stage that
stashes it to the one that pops it, with the forward, and its gradient straight back, with
the backward. `lower` turns a validated schedule and the skip routes of a split into a
`LoweredSchedule`; the executors run it (`executor.run_program`), and their transports
only move keyed messages: the threaded `Mailbox`, `torch.distributed` sends and receives.

API
---
``lower(schedule, routes=()) -> LoweredSchedule``
    Validate ``schedule`` (`schedules.validate`: its `ScheduleError` names rank, step and
    micro-batch), lower it with the skip ``routes``, and check the result
    (`validate_lowered`).
``lower_forward(stages, microbatches, routes=()) -> LoweredSchedule``
    The classic ``pipe(x)``: stage ``s`` is rank ``s`` and runs forwards only (autograd
    runs the backward).
``validate_lowered(lowered)``
    Every send has exactly one receive, from and to the right ranks, and the reverse; no
    rank waits for a message sent after it in another's program (each rank blocks only on
    its receives, sends never block). Raises `ScheduleError` naming the rank, the step,
    the message, and the compute actions involved.
``outputs(action, stages, routes) -> list[Message]``
    The rule: what ``action`` produces for other stages.
``LoweredSchedule``
    ``schedule`` (the compute-only `Schedule`), ``routes``, ``programs[rank]`` (a tuple of
    `Step`), ``ranks``; ``ops(rank, local=False)`` (the flat op list: `Receive`, `Action`,
    `Send`), ``text(rank, local=False)``, ``grid(local=False)``, ``channel(src, dst)``
    (the messages rank ``src`` sends rank ``dst``, in the order it sends them: a receiver
    on a link that matches by order receives in this order), ``pairs()`` (the ``(src,
    dst)`` rank pairs that exchange messages, sorted).
``Step(action, receives, sends)``
    A compute `schedules.Action`, the `Receive`s right before it (its input first, then
    the skip tensors or their gradients), and the `Send`s right after it (its output
    first, then the skips).
``Receive(peer, message, local)``, ``Send(peer, message, local)``
    ``peer``: the rank it comes from or goes to. ``local``: that rank is this one (two
    stages of one rank: a V's turn, interleaved stages on one rank, ``pp = 1``).
``Message(kind, stage, microbatch, source, skip=None)``
    The key every transport moves a value by. ``kind``: ``"activation"``,
    ``"gradient"``, ``"skip"`` (a stashed tensor) or ``"skip-grad"`` (its gradient);
    ``stage``: the stage that consumes it; ``source``: the stage that produces it;
    ``skip``: the `skip.SkipKey` of a skip message.

Messages between two stages of one rank
---------------------------------------
They are lowered like the others, with ``local=True``, and handed over in memory by
`executor.run_program`; transports never see them. The text form leaves them out, as
PyTorch's lowering does (``local=True`` shows them).

Text
----
PyTorch's notation for its lowered programs (``torch.distributed.pipelining.schedules``,
``_Action``): a compute action is ``{stage}{F|B|I|W}{micro-batch}`` (``1F0``, ``1I3``,
``1W3``, ``0B1``); a send is written with the sending stage, a receive with the receiving
stage: ``0SEND_F0`` (stage 0's output of micro-batch 0), ``1RECV_F0`` (stage 1's input),
``1SEND_B0``, ``0RECV_B0``. Skip messages have no PyTorch equivalent: ``SEND_SKIP_F`` /
``RECV_SKIP_F`` for a stashed tensor and ``SEND_SKIP_B`` / ``RECV_SKIP_B`` for its
gradient, the skip's name in brackets: ``0SEND_SKIP_F1[shortcut]``, ``2RECV_SKIP_F1[shortcut]``.
So ``str(op)`` of an activation or gradient op is the string PyTorch's
``_Action.from_str`` reads.

Example::

    >>> print(lower(one_f_one_b(2, 2)).grid())
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

from pipeline_lib.schedules import (Action, Schedule, ScheduleError, cycle_collector_paused,
                                    destination, splits_backward, validate)
from pipeline_lib.skip import DEFAULT_NAMESPACE, SkipKey, SkipRoute, describe

MessageKind = Literal["activation", "gradient", "skip", "skip-grad"]
FORWARD_KINDS = ("activation", "skip")       # consumed by a forward; the others by a backward
_TEXT = {"activation": "F", "gradient": "B", "skip": "SKIP_F", "skip-grad": "SKIP_B"}
_WORDS = {"activation": "the activation", "gradient": "the gradient",
          "skip": "the skip tensor", "skip-grad": "the gradient of skip tensor"}


class Message(NamedTuple):
    """What one action hands to one action of another stage (see the module docstring).
    A tuple: transports use it as a key, many times per step."""

    kind: MessageKind
    stage: int          # the stage that consumes it
    microbatch: int
    source: int         # the stage that produces it
    skip: SkipKey | None = None

    def __str__(self) -> str:
        what = _WORDS[self.kind] if self.skip is None else \
            f"{_WORDS[self.kind]} {describe(self.skip)}"
        return f"{what} for stage {self.stage}, micro-batch {self.microbatch}"


def _op_text(stage: int, verb: str, message: Message) -> str:
    text = f"{stage}{verb}_{_TEXT[message.kind]}{message.microbatch}"
    if message.skip is None:
        return text
    namespace, name = message.skip
    if namespace != DEFAULT_NAMESPACE:
        name = f"{name}@{namespace.label or str(namespace.uid)[:8]}"
    return f"{text}[{name}]"


class _Transfer(NamedTuple):
    peer: int          # the rank it comes from (a receive) or goes to (a send)
    message: Message
    local: bool        # that rank is this one: handed over in memory


class Receive(_Transfer):
    """Wait for ``message`` from rank ``peer`` (``local``: this rank, in memory)."""

    __slots__ = ()

    def __str__(self) -> str:
        return _op_text(self.message.stage, "RECV", self.message)


class Send(_Transfer):
    """Hand ``message`` to rank ``peer`` (``local``: this rank, in memory); never waits."""

    __slots__ = ()

    def __str__(self) -> str:
        return _op_text(self.message.source, "SEND", self.message)


Op = Receive | Action | Send


class Step(NamedTuple):
    """One compute action with the receives right before it and the sends right after."""

    action: Action
    receives: tuple[Receive, ...]
    sends: tuple[Send, ...]

    def ops(self) -> list[Op]:
        return [*self.receives, self.action, *self.sends]


@dataclass(frozen=True, eq=False)
class LoweredSchedule:
    """A schedule's per-rank programs with their messages (see the module docstring)."""

    schedule: Schedule
    routes: tuple[SkipRoute, ...]
    programs: tuple[tuple[Step, ...], ...]

    @property
    def ranks(self) -> int:
        return len(self.programs)

    def ops(self, rank: int, local: bool = False) -> list[Op]:
        """Rank ``rank``'s program as one list, receives and sends in place; messages
        within the rank only with ``local=True``."""
        return [op for step in self.programs[rank] for op in step.ops()
                if local or isinstance(op, Action) or not op.local]

    def text(self, rank: int, local: bool = False) -> str:
        return " ".join(str(op) for op in self.ops(rank, local))

    def grid(self, local: bool = False) -> str:
        return "\n".join(f"rank {r}: {self.text(r, local)}" for r in range(self.ranks))

    def channel(self, src: int, dst: int) -> list[Message]:
        """The messages rank ``src`` sends rank ``dst`` (``src != dst``), in its order."""
        return [send.message for step in self.programs[src] for send in step.sends
                if send.peer == dst and not send.local]

    def pairs(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` rank pairs with at least one message, sorted."""
        return sorted({(r, send.peer) for r, program in enumerate(self.programs)
                       for step in program for send in step.sends if not send.local})

    def __str__(self) -> str:
        return f"{self.schedule.name}, lowered\n{self.grid()}"


# -- the rule ---------------------------------------------------------------------------

def outputs(action: Action, stages: int, routes: Sequence[SkipRoute]) -> list[Message]:
    """What ``action`` produces for other stages: a forward, its output for the next stage
    (`schedules.destination`) and the skip tensors it stashes for the stages that pop
    them; a backward (B or I), its input gradient for the previous stage and the
    gradients of the skip tensors it popped, for the stages that stashed them. A W
    produces nothing for another stage."""
    s, i = action.stage, action.microbatch
    to = destination(action, stages)
    if action.kind == "F":
        made = [] if to is None else [Message("activation", to, i, s)]
        return made + [Message("skip", r.target, i, s, r.key) for r in routes if r.source == s]
    if action.kind in ("B", "I"):
        made = [] if to is None else [Message("gradient", to, i, s)]
        return made + [Message("skip-grad", r.source, i, s, r.key)
                       for r in routes if r.target == s]
    return []


def _consumer(message: Message, split: frozenset[tuple[int, int]]) -> Action:
    """The action that consumes ``message``: the forward, or the backward (I where the
    stage's backward of that micro-batch is split), of its stage and micro-batch."""
    s, i = message.stage, message.microbatch
    if message.kind in FORWARD_KINDS:
        return Action(s, "F", i)
    return Action(s, "I" if (s, i) in split else "B", i)


# -- lowering ---------------------------------------------------------------------------

def lower(schedule: Schedule, routes: Sequence[SkipRoute] = ()) -> LoweredSchedule:
    """``schedule`` (validated first) with the messages of its stages and of the skip
    ``routes``, as each rank's program of `Step`s (see the module docstring)."""
    validate(schedule)
    return _lowered(schedule, routes)


def lower_forward(stages: int, microbatches: int,
                  routes: Sequence[SkipRoute] = ()) -> LoweredSchedule:
    """The forwards of the classic ``pipe(x)``, one rank per stage: autograd runs the
    backward, so only activations and skip tensors travel."""
    programs = [[Action(s, "F", i) for i in range(microbatches)] for s in range(stages)]
    return _lowered(Schedule("forward", stages, microbatches, programs), routes)


def _lowered(schedule: Schedule, routes: Sequence[SkipRoute]) -> LoweredSchedule:
    routes, stages = tuple(routes), schedule.stages
    split = splits_backward(schedule)
    for route in routes:
        if not (0 <= route.source < route.target < stages):
            raise ScheduleError(f"{schedule.name}: skip route {describe(route.key)} from stage "
                                f"{route.source} to stage {route.target} does not go forward "
                                f"between two of its {stages} stages")
    order = {route.key: k for k, route in enumerate(routes)}
    receives: dict[Action, list[Receive]] = defaultdict(list)
    sends: dict[Action, tuple[Send, ...]] = {}
    with cycle_collector_paused():
        for rank, program in enumerate(schedule.actions):
            for action in program:
                made = []
                for message in outputs(action, stages, routes):
                    to = schedule.rank_of(message.stage)
                    made.append(Send(to, message, to == rank))
                    receives[_consumer(message, split)].append(Receive(rank, message, to == rank))
                sends[action] = tuple(made)
        first = lambda r: (r.message.skip is not None, order.get(r.message.skip, -1))  # noqa: E731
        programs = tuple(tuple(Step(a, tuple(sorted(receives.pop(a, ()), key=first)), sends[a])
                               for a in program) for program in schedule.actions)
    lowered = LoweredSchedule(schedule, routes, programs)
    validate_lowered(lowered)
    return lowered


# -- validation ---------------------------------------------------------------------------

def _where(lowered: LoweredSchedule) -> tuple[dict[Message, tuple[int, int, Send]],
                                             dict[Message, tuple[int, int, Receive]]]:
    """Each message's send and receive as ``(rank, step, op)``, after checking that every
    message is sent once and received once, by the ranks the other side names."""
    name = lowered.schedule.name
    sent: dict[Message, tuple[int, int, Send]] = {}
    got: dict[Message, tuple[int, int, Receive]] = {}
    for rank, program in enumerate(lowered.programs):
        for step, compute in enumerate(program):
            for ops, seen in ((compute.sends, sent), (compute.receives, got)):
                for op in ops:
                    if op.message in seen:
                        r, k, _ = seen[op.message]
                        raise ScheduleError(f"{name}: rank {rank} step {step}: {op} "
                                            f"({op.message}) appears twice (also rank {r} "
                                            f"step {k})")
                    seen[op.message] = (rank, step, op)
    for message, (rank, step, send) in sent.items():
        if message not in got:
            raise ScheduleError(f"{name}: rank {rank} step {step}: {send} sends {message} to "
                                f"rank {send.peer}, which never receives it")
        r, k, receive = got[message]
        if r != send.peer or receive.peer != rank:
            raise ScheduleError(f"{name}: rank {rank} step {step}: {send} sends {message} to "
                                f"rank {send.peer}, but rank {r} receives it (step {k}, "
                                f"{receive}) from rank {receive.peer}")
    for message, (rank, step, receive) in got.items():
        if message not in sent:
            raise ScheduleError(f"{name}: rank {rank} step {step}: {receive} waits for "
                                f"{message} from rank {receive.peer}, which never sends it")
    return sent, got


def validate_lowered(lowered: LoweredSchedule) -> None:
    """Raise `ScheduleError` unless every message is sent once and received once by the
    ranks named on both sides, and the programs run to their ends when each rank waits
    only for its receives (sends never wait): each message is then always sent before
    it is waited for, whatever the ranks' speeds. Linear time: a rank is woken only by
    the message it waits for."""
    sent, _ = _where(lowered)
    programs = lowered.programs
    pc = [0] * len(programs)
    arrived: set[Message] = set()
    waiting: dict[Message, list[int]] = defaultdict(list)
    ready = list(range(len(programs)))
    while ready:
        rank = ready.pop()
        program, step = programs[rank], pc[rank]
        while step < len(program):
            missing = next((r.message for r in program[step].receives
                            if r.message not in arrived), None)
            if missing is not None:
                waiting[missing].append(rank)
                break
            for send in program[step].sends:
                arrived.add(send.message)
                ready += waiting.pop(send.message, [])
            step += 1
        pc[rank] = step
    stuck = [r for r in range(len(programs)) if pc[r] < len(programs[r])]
    if stuck:
        lines = []
        for rank in stuck:
            step = programs[rank][pc[rank]]
            receive = next(r for r in step.receives if r.message not in arrived)
            by, at, send = sent[receive.message]
            producer = programs[by][at].action
            lines.append(f"rank {rank} step {pc[rank]}: {receive} (for {step.action}) waits "
                         f"for {receive.message}, which rank {by} sends at its step {at} "
                         f"({send}, after {producer}); rank {by} never gets there (it "
                         f"waits at its step {pc[by]})")
        raise ScheduleError(f"{lowered.schedule.name} would deadlock:\n  " + "\n  ".join(lines))
