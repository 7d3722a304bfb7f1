"""Pipeline schedules as data: an ordered list of actions per rank.

One representation serves everything: the simulator, the Gantt plots, the threaded
executor and the multi-process executor all read the same `Schedule`, so what a notebook
draws is exactly what runs.

Vocabulary
----------
* A *stage* is a contiguous slice of the model. With interleaving, a rank (device) holds
  several stages: stage ``s`` lives on rank ``s % ranks``.
* An *action* is one unit of work of one micro-batch on one stage:
  ``F`` forward, ``B`` full backward, or the two halves of a split backward used by the
  zero-bubble schedules: ``I`` (gradient w.r.t. the stage input, which the previous stage
  is waiting for) and ``W`` (gradient w.r.t. the weights, which nobody waits for).
* Written ``{stage}{kind}{microbatch}``: ``0F1`` is the forward of micro-batch 1 on stage 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["F", "B", "I", "W"]
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass
class Schedule:
    """Which action each rank runs, in order. ``actions[r]`` is rank ``r``'s program."""

    name: str
    ranks: int
    microbatches: int
    actions: list[list[Action]]
    virtual_stages: int = 1
    meta: dict = field(default_factory=dict)

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def grid(self) -> str:
        """Text picture of the program order (not of time: see `simulate` for that)."""
        width = max((len(str(a)) for prog in self.actions for a in prog), default=3)
        rows = []
        for rank, program in enumerate(self.actions):
            cells = " ".join(str(a).rjust(width) for a in program)
            rows.append(f"rank {rank}: {cells}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return f"{self.name} (ranks={self.ranks}, microbatches={self.microbatches}, " \
               f"virtual_stages={self.virtual_stages})\n{self.grid()}"


# ---------------------------------------------------------------------------------------
# Builders. Each one fits on a screen; `validate` checks every one of them in the tests.
# ---------------------------------------------------------------------------------------

def _check_sizes(ranks: int, microbatches: int) -> None:
    if ranks < 1 or microbatches < 1:
        raise ValueError(f"need ranks >= 1 and microbatches >= 1, got ranks={ranks}, "
                         f"microbatches={microbatches}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Fill-drain: every forward, then every backward. Simple, holds all m activations."""
    _check_sizes(stages, microbatches)
    m = range(microbatches)
    actions = [[Action(s, "F", i) for i in m] + [Action(s, "B", i) for i in m]
               for s in range(stages)]
    return Schedule("GPipe", stages, microbatches, actions)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: after a short warm-up each rank alternates one forward and one backward.

    Same bubble as GPipe, but stage ``s`` never holds more than ``min(stages - s, m)``
    micro-batches' activations instead of all ``m``.
    """
    _check_sizes(stages, microbatches)
    actions = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        program = [Action(s, "F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            program += [Action(s, "F", warmup + i), Action(s, "B", i)]
        program += [Action(s, "B", i) for i in range(microbatches - warmup, microbatches)]
        actions.append(program)
    return Schedule("1F1B", stages, microbatches, actions)


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: each of ``stages`` ranks holds ``virtual_stages``
    model chunks (stage ``c * stages + r`` on rank ``r``), so a micro-batch visits every
    rank ``virtual_stages`` times in smaller steps and the fill/drain bubble shrinks by
    that factor.

    Micro-batches go through in groups of ``stages``; so ``microbatches`` must be a
    multiple of ``stages`` (as in Megatron-LM).
    """
    _check_sizes(stages, microbatches)
    p, v, m = stages, virtual_stages, microbatches
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}")
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches through in groups of "
                         f"{p} (one per rank): microbatches={m} is not a multiple of "
                         f"{p}; use {m + p - m % p} or {m - m % p or p} micro-batches")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        """The k-th (chunk, micro-batch) a rank works on, forward or backward."""
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    actions = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        program: list[Action] = []
        f = b = 0
        for _ in range(warmup):
            c, i = unit(f, True)
            program.append(Action(c * p + r, "F", i)); f += 1
        while b < total:
            if f < total:
                c, i = unit(f, True)
                program.append(Action(c * p + r, "F", i)); f += 1
            c, i = unit(b, False)
            program.append(Action(c * p + r, "B", i)); b += 1
        actions.append(program)
    return Schedule(f"Interleaved 1F1B (v={v})", p, m, actions, virtual_stages=v)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """Zero-bubble H1 (Qi et al., 2023): 1F1B with each backward split into ``I`` (input
    gradient, which the previous stage waits for) and ``W`` (weight gradient, which
    nobody waits for).

    Input gradients travel back sooner, and stage ``s`` runs each ``W`` ``s``
    micro-batches late, so the deferred ``W`` fill the drain bubble: with F = I = W the
    bubble falls from 1F1B's (p-1)·3F to (p-1)·F. Every stage then holds up to ``p``
    micro-batches, which is 1F1B's peak (on stage 0): the same peak memory.
    """
    _check_sizes(stages, microbatches)
    p, m = stages, microbatches
    actions = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        program = [Action(s, "F", i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                program.append(Action(s, "F", warmup + i))
            program.append(Action(s, "I", i))
            if i >= s:
                program.append(Action(s, "W", i - s))
        program += [Action(s, "W", i) for i in range(max(m - s, 0), m)]
        actions.append(program)
    return Schedule("ZB-H1", p, m, actions)


BUILDERS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
}


def build(name: str, stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Look a schedule up by name, as used by `Pipe.step` and the command line."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(BUILDERS)} "
                         f"or pass a Schedule object")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(stages, microbatches, virtual_stages)
    return BUILDERS[name](stages, microbatches)


def plan(schedule: str | Schedule, pp: int, stages: int, microbatches: int) -> Schedule:
    """The schedule for ``stages`` stages on ``pp`` ranks: built by name (interleaved 1F1B
    puts ``stages // pp`` on each rank), or checked against the sizes if given."""
    if isinstance(schedule, str):
        if schedule == "interleaved_1f1b":
            if stages % pp:
                raise ValueError(f"interleaved_1f1b puts the same number of stages on every "
                                 f"rank: {stages} stages on {pp} ranks do not divide; give a "
                                 f"balance with a multiple of {pp} entries")
            schedule = build(schedule, pp, microbatches, virtual_stages=stages // pp)
        elif stages != pp:
            raise ValueError(f"{schedule} runs one stage per rank: the balance has {stages} "
                             f"stages for {pp} pipeline ranks; give {pp} entries (or use "
                             f"interleaved_1f1b for several stages per rank)")
        else:
            schedule = build(schedule, pp, microbatches)
    if (schedule.ranks, schedule.stages, schedule.microbatches) != (pp, stages, microbatches):
        raise ValueError(f"schedule {schedule.name!r} is for {schedule.ranks} ranks, "
                         f"{schedule.stages} stages and {schedule.microbatches} micro-batches, "
                         f"not {pp} ranks, {stages} stages and {microbatches} micro-batches")
    validate(schedule)
    return schedule


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

class ScheduleError(ValueError):
    """A schedule that is incomplete, breaks a dependency, or would deadlock."""


def dependencies(action: Action, stages: int, split_backward: bool) -> list[Action]:
    """The actions whose results `action` consumes.

    F needs the previous stage's F; a backward (B or I) needs its own stage's F and the
    next stage's backward (the last stage instead starts from the loss); W needs the I
    that produced the gradient of the stage output.
    """
    s, i = action.stage, action.microbatch
    back = "I" if split_backward else "B"
    if action.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if action.kind in ("B", "I"):
        deps = [Action(s, "F", i)]
        if s < stages - 1:
            deps.append(Action(s + 1, back, i))
        return deps
    return [Action(s, "I", i)]


def splits_backward(schedule: Schedule) -> bool:
    """Zero-bubble schedules split every backward into I and W; the others never do."""
    return any(a.kind in ("I", "W") for program in schedule.actions for a in program)


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` naming the rank, step and micro-batch of the first problem.

    Checks that every (stage, micro-batch) gets exactly one forward and one backward
    (B, or I and W), on the rank that owns the stage, and that running the programs in
    order can never deadlock: a step-by-step execution in which every rank waits for the
    actions it depends on must finish every program.
    """
    p, S, m = schedule.ranks, schedule.stages, schedule.microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: has programs for {len(schedule.actions)} "
                            f"ranks, expected {p}")
    split = splits_backward(schedule)
    where: dict[Action, tuple[int, int]] = {}
    for r, program in enumerate(schedule.actions):
        for step, a in enumerate(program):
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r} step {step}: unknown action kind {a.kind!r}")
            if not (0 <= a.stage < S and 0 <= a.microbatch < m):
                raise ScheduleError(f"rank {r} step {step}: {a} is out of range "
                                    f"(stages 0..{S - 1}, micro-batches 0..{m - 1})")
            if schedule.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} step {step}: {a} belongs to stage {a.stage}, "
                                    f"which lives on rank {schedule.rank_of(a.stage)}")
            if a in where:
                raise ScheduleError(f"rank {r} step {step}: {a} (micro-batch {a.microbatch}"
                                    f" on stage {a.stage}) appears twice")
            where[a] = (r, step)
    kinds = ("F", "I", "W") if split else ("F", "B")
    for a, (r, step) in where.items():
        if a.kind not in kinds:
            raise ScheduleError(f"rank {r} step {step}: {a} mixes a full backward B with "
                                f"split I/W backwards; use one or the other")
    for s in range(S):
        for i in range(m):
            for k in kinds:
                if Action(s, k, i) not in where:
                    raise ScheduleError(f"{schedule.name}: stage {s} never runs {k} of "
                                        f"micro-batch {i} (action {Action(s, k, i)}), "
                                        f"on rank {schedule.rank_of(s)}")

    done: set[Action] = set()
    pc = [0] * p
    while True:
        progressed = False
        for r in range(p):
            while pc[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pc[r]]
                if any(d not in done for d in dependencies(a, S, split)):
                    break
                done.add(a); pc[r] += 1; progressed = True
        if not progressed:
            break
    stuck = [(r, pc[r], schedule.actions[r][pc[r]]) for r in range(p)
             if pc[r] < len(schedule.actions[r])]
    if stuck:
        lines = []
        for r, step, a in stuck:
            missing = [d for d in dependencies(a, S, split) if d not in done]
            waits = ", ".join(f"{d} (rank {where[d][0]} step {where[d][1]})" for d in missing)
            lines.append(f"rank {r} step {step}: {a} (micro-batch {a.microbatch}, stage "
                         f"{a.stage}) waits for {waits}")
        raise ScheduleError(f"{schedule.name} would deadlock:\n  " + "\n  ".join(lines))
