"""Timelines: when each action ran on each rank, simulated or measured.

The simulator and both executors produce the same `Timeline`, so a measured run is drawn
with the same Gantt function and its bubble compared with the prediction number for number.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Sequence

from pipeline_lib.schedules import Action, Schedule, dependencies, splits_backward, validate


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Events of one training step. ``unit`` is "s" for wall clock, "" for simulated."""

    ranks: int
    events: list[Event] = field(default_factory=list)
    unit: str = "s"
    title: str = ""

    @property
    def makespan(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self) -> list[float]:
        """Time each rank spent computing."""
        total = [0.0] * self.ranks
        for e in self.events:
            total[e.rank] += e.duration
        return total

    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: 1 - busy / (ranks × makespan)."""
        span = self.makespan
        return 0.0 if span == 0 else 1.0 - sum(self.busy()) / (self.ranks * span)

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most micro-batches (per stage) whose activations it held at once.

        A micro-batch is held on a stage from the start of its forward to the end of its
        last backward action (B, or W for split backwards): that is what activation
        memory is proportional to, checkpointing aside.
        """
        last_backward = {}
        for e in self.events:
            if e.action.kind in ("B", "W"):
                last_backward[(e.action.stage, e.action.microbatch)] = e.end
            elif e.action.kind == "I":
                key = (e.action.stage, e.action.microbatch)
                last_backward.setdefault(key, e.end)
        changes: list[list[tuple[float, int]]] = [[] for _ in range(self.ranks)]
        for e in self.events:
            if e.action.kind == "F":
                key = (e.action.stage, e.action.microbatch)
                changes[e.rank].append((e.start, +1))
                changes[e.rank].append((last_backward.get(key, float("inf")), -1))
        peaks = []
        for rank_changes in changes:
            held = peak = 0
            for _, delta in sorted(rank_changes):  # at equal times, releases (-1) go first
                held += delta
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "unit": self.unit, "title": self.title,
                "events": [{"rank": e.rank, "start": e.start, "end": e.end,
                            **asdict(e.action)} for e in self.events]}

    @classmethod
    def from_dict(cls, data: dict) -> "Timeline":
        events = [Event(d["rank"], Action(d["stage"], d["kind"], d["microbatch"]),
                        d["start"], d["end"]) for d in data["events"]]
        return cls(data["ranks"], events, data.get("unit", "s"), data.get("title", ""))

    def shifted(self) -> "Timeline":
        """The same events with time measured from the first start."""
        t0 = min((e.start for e in self.events), default=0.0)
        events = [Event(e.rank, e.action, e.start - t0, e.end - t0) for e in self.events]
        return Timeline(self.ranks, events, self.unit, self.title)


Cost = float | Sequence[float]


def _per_stage(cost: Cost, stages: int, name: str) -> list[float]:
    if isinstance(cost, (int, float)):
        return [float(cost)] * stages
    if len(cost) != stages:
        raise ValueError(f"{name} has {len(cost)} per-stage costs, expected {stages}")
    return [float(c) for c in cost]


def simulate(schedule: Schedule, forward: Cost = 1.0, backward: Cost = 2.0,
             weight: Cost | None = None, comm: float = 0.0) -> Timeline:
    """Run a schedule on ideal devices: each action starts as soon as its rank is free
    and its inputs have arrived (``comm`` later when they come from another rank).

    Costs are per action, a number or one per stage. ``backward`` is the cost of a full
    backward; a split backward costs ``backward - weight`` for I and ``weight`` for W
    (``weight`` defaults to half the backward, as for matrix multiplies, where the input
    and weight gradients are one GEMM each).
    """
    validate(schedule)
    S = schedule.stages
    f = _per_stage(forward, S, "forward")
    b = _per_stage(backward, S, "backward")
    w = _per_stage(weight, S, "weight") if weight is not None else [x / 2 for x in b]
    cost = {"F": f, "B": b, "I": [x - y for x, y in zip(b, w)], "W": w}
    split = splits_backward(schedule)

    end: dict[Action, float] = {}
    clock = [0.0] * schedule.ranks
    pc = [0] * schedule.ranks
    events = []
    remaining = sum(len(p) for p in schedule.actions)
    while remaining:
        best = None
        for r, program in enumerate(schedule.actions):
            if pc[r] == len(program):
                continue
            a = program[pc[r]]
            deps = dependencies(a, S, split)
            if any(d not in end for d in deps):
                continue
            start = max([clock[r]] + [end[d] + (comm if schedule.rank_of(d.stage) != r
                                                  else 0.0) for d in deps])
            if best is None or start < best[0]:
                best = (start, r, a)
        start, r, a = best  # validate() guarantees progress
        clock[r] = end[a] = start + cost[a.kind][a.stage]
        events.append(Event(r, a, start, end[a]))
        pc[r] += 1
        remaining -= 1
    return Timeline(schedule.ranks, events, unit="", title=schedule.name)


def bubble_theory(ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble share of total time for fill-drain schedules with equal stages and B = 2F:
    (p - 1) / (v·m + p - 1); with v = 1 this is GPipe's and 1F1B's (p - 1) / (m + p - 1)."""
    p, m, v = ranks, microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def simulate_measured(schedule: Schedule, timeline: Timeline) -> Timeline:
    """The simulator fed this run's mean time per (stage, action kind): what the schedule
    would do on these stages with free communication and no overhead. Its bubble is the
    one a measured run should approach."""
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in timeline.events:
        durations[(e.action.stage, e.action.kind)].append(e.duration)

    def mean(kind: str) -> list[float]:
        missing = [s for s in range(schedule.stages) if not durations[(s, kind)]]
        if missing:
            raise ValueError(f"the timeline has no {kind} action on stages {missing}: it is "
                             f"not a run of {schedule.name} with {schedule.stages} stages")
        return [sum(d) / len(d) for d in (durations[(s, kind)] for s in range(schedule.stages))]

    if splits_backward(schedule):
        weight = mean("W")
        backward = [i + w for i, w in zip(mean("I"), weight)]
        simulated = simulate(schedule, mean("F"), backward, weight)
    else:
        simulated = simulate(schedule, mean("F"), mean("B"))
    simulated.unit = timeline.unit   # the costs were measured in the timeline's unit
    return simulated
