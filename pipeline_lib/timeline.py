"""Timelines: when each action ran on each rank, simulated or measured.

The simulator and both executors produce the same `Timeline`, so a measured run is drawn
with the same Gantt function and its bubble compared with the prediction number for number.
"""
from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Mapping, NamedTuple, Sequence

from pipeline_lib.schedules import (Action, Schedule, cycle_collector_paused, destination,
                                    execution_order)


class Event(NamedTuple):
    """One action on one rank, from ``start`` to ``end``. A tuple, like `Action`: the
    simulator makes one per action, hundreds of thousands for a large pipeline."""

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
        return [round(peak) for peak in self.peak_activations()]

    def peak_activations(self, stage_size: Sequence[float] | None = None) -> list[float]:
        """`peak_in_flight` with a micro-batch held on stage ``s`` counting
        ``stage_size[s]`` (1 for every stage if not given): a chunk that holds half as
        many layers holds half as many activations.

        A rank runs its actions one after another, so at equal times (actions that cost
        nothing, or a backward ending as the next forward starts) the rank's own order
        decides: a micro-batch taken before action k and one released after action j < k
        were never held together; one released after k was. Sorting by time alone cannot
        tell, and gave GPipe with zero costs a peak of 0.
        """
        turn = self._turns()
        after_i: dict[tuple[int, int], tuple[float, int]] = {}    # (stage, mb) -> when
        after_bw: dict[tuple[int, int], tuple[float, int]] = {}
        for index, e in enumerate(self.events):
            key = (e.action.stage, e.action.microbatch)
            when = (e.end, 2 * turn[index] + 1)                   # just after the action
            if e.action.kind in ("B", "W"):
                after_bw[key] = max(after_bw.get(key, when), when)
            elif e.action.kind == "I":
                after_i[key] = when
        release = after_i | after_bw                # the last B or W, else the I
        changes: list[list[tuple[float, int, float]]] = [[] for _ in range(self.ranks)]
        for index, e in enumerate(self.events):
            if e.action.kind == "F":
                key = (e.action.stage, e.action.microbatch)
                size = 1.0 if stage_size is None else stage_size[e.action.stage]
                changes[e.rank].append((e.start, 2 * turn[index], size))   # just before it
                changes[e.rank].append((*release.get(key, (math.inf, 0)), -size))
        peaks = []
        for rank_changes in changes:
            held = peak = 0.0
            for _, _, delta in sorted(rank_changes):
                held += delta
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def _turns(self) -> list[int]:
        """Each event's place in its rank's order: by start, then as listed."""
        turns = [0] * len(self.events)
        seen = [0] * self.ranks
        for index in sorted(range(len(self.events)), key=lambda k: self.events[k].start):
            rank = self.events[index].rank
            turns[index], seen[rank] = seen[rank], seen[rank] + 1
        return turns

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "unit": self.unit, "title": self.title,
                "events": [{"rank": e.rank, "start": e.start, "end": e.end,
                            **e.action._asdict()} for e in self.events]}

    @classmethod
    def from_dict(cls, data: dict) -> "Timeline":
        """The inverse of `to_dict` (a saved ``--timeline`` file, read back with
        ``json.load``); a file that is not one is refused, naming the first bad entry."""
        fix = "give the dict Timeline.to_dict made (what lm.train --timeline writes)"
        if not isinstance(data, Mapping) or not isinstance(data.get("events"), list) or \
                not _is_index(data.get("ranks")) or data["ranks"] < 1:
            raise ValueError(f"not a timeline: expected a dict with 'ranks' (an int >= 1) "
                             f"and 'events' (a list); {fix}")
        events = []
        for k, d in enumerate(data["events"]):
            events.append(_event_from_dict(d, data["ranks"], f"event {k} ({d!r:.80})", fix))
        return cls(data["ranks"], events, data.get("unit", "s"), data.get("title", ""))

    def shifted(self) -> "Timeline":
        """The same events with time measured from the first start."""
        t0 = min((e.start for e in self.events), default=0.0)
        events = [Event(e.rank, e.action, e.start - t0, e.end - t0) for e in self.events]
        return Timeline(self.ranks, events, self.unit, self.title)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _event_from_dict(d: Any, ranks: int, where: str, fix: str) -> Event:
    keys = ("rank", "stage", "kind", "microbatch", "start", "end")
    if not isinstance(d, Mapping) or any(k not in d for k in keys):
        raise ValueError(f"{where} needs the keys {list(keys)}; {fix}")
    if not all(_is_index(d[k]) and d[k] >= 0 for k in ("rank", "stage", "microbatch")) \
            or d["rank"] >= ranks or d["kind"] not in ("F", "B", "I", "W"):
        raise ValueError(f"{where}: rank (below {ranks}), stage and microbatch must be ints "
                         f">= 0 and kind one of F, B, I, W; {fix}")
    times = (d["start"], d["end"])
    if not all(isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
               for t in times) or d["end"] < d["start"]:
        raise ValueError(f"{where}: start and end must be finite numbers, end >= start; "
                         f"{fix}")
    return Event(d["rank"], Action(d["stage"], d["kind"], d["microbatch"]),
                 float(d["start"]), float(d["end"]))


Cost = float | Sequence[float]


def _check_cost(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} is {value}: a cost is a duration, a finite number >= 0")
    return value


def _per_stage(cost: Cost, stages: int, name: str) -> list[float]:
    if isinstance(cost, numbers.Real):
        return [_check_cost(cost, name)] * stages
    if isinstance(cost, (str, bytes, Mapping)) or not hasattr(cost, "__len__"):
        # a dict has a length too, and iterating it gives its keys: {0: 1.0, 1: 2.0}
        # would cost stage 1 one unit, its key, not two
        raise TypeError(f"{name} must be a number or one number per stage, got {cost!r}: "
                        f"give a sequence with stage s's cost at index s")
    if len(cost) != stages:
        raise ValueError(f"{name} has {len(cost)} per-stage costs, expected {stages}")
    return [_check_cost(c, f"{name}[{s}]") for s, c in enumerate(cost)]


def simulate(schedule: Schedule, forward: Cost = 1.0, backward: Cost = 2.0,
             weight: Cost | None = None, comm: float = 0.0) -> Timeline:
    """Run a schedule on ideal devices: each action starts as soon as its rank is free
    and its inputs have arrived (``comm`` later when they come from another rank).

    Costs are per action, a number or one per stage, finite and >= 0. ``backward`` is the
    cost of a full backward; a split backward costs ``backward - weight`` for I and
    ``weight`` for W (``weight`` defaults to half the backward, as for matrix multiplies,
    where the input and weight gradients are one GEMM each), so ``weight <= backward``.

    Start times follow from the schedule alone (each action starts when its rank's
    previous action and its inputs are done), so the actions are timed in any order that
    respects those: `execution_order`'s, which takes time linear in their number.
    """
    order = execution_order(schedule)      # validates it before anything reads it
    S = schedule.stages
    f = _per_stage(forward, S, "forward")
    b = _per_stage(backward, S, "backward")
    w = _per_stage(weight, S, "weight") if weight is not None else [x / 2 for x in b]
    for s, (wb, bb) in enumerate(zip(w, b)):
        if wb > bb:
            raise ValueError(f"weight cost {wb} of stage {s} exceeds its backward cost {bb}: "
                             f"backward is the whole backward (I + W), so W cannot cost more")
    comm = _check_cost(comm, "comm")
    cost = {"F": f, "B": b, "I": [x - y for x, y in zip(b, w)], "W": w}

    with cycle_collector_paused():
        return _simulate(schedule, order, cost, comm)


def _simulate(schedule: Schedule, order: list[tuple[int, Action, list[Action]]],
              cost: dict[str, list[float]], comm: float) -> Timeline:
    rank_of = [schedule.rank_of(s) for s in range(schedule.stages)]
    end: dict[Action, float] = {}
    clock = [0.0] * schedule.ranks
    events = []
    for r, a, deps in order:
        start = clock[r]
        for d in deps:
            arrival = end[d] + comm if rank_of[d.stage] != r else end[d]
            if arrival > start:
                start = arrival
        clock[r] = end[a] = finish = start + cost[a.kind][a.stage]
        events.append(Event(r, a, start, finish))
    events.sort(key=itemgetter(2, 0))   # by start, then rank
    return Timeline(schedule.ranks, events, unit="", title=schedule.name)


def bubble_theory(ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble share of total time for fill-drain schedules with equal stages and B = 2F:
    (p - 1) / (v·m + p - 1); with v = 1 this is GPipe's and 1F1B's (p - 1) / (m + p - 1)."""
    p, m, v = ranks, microbatches, virtual_stages
    if min(p, m, v) < 1:
        raise ValueError(f"bubble_theory needs ranks, microbatches and virtual_stages >= 1, "
                         f"got {p}, {m} and {v}")
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True)
class RankFacts:
    """One rank's share of a step, in units that compare across schedules.

    Memory counts *stages*, a stage being a ``1/ranks`` share of the model (what a rank
    holds under 1F1B): a rank holding two chunks of half a stage each (V-shaped, or
    interleaved with v = 2) holds 1 stage of parameters, and a micro-batch's activations
    on one chunk count ½. (DualPipeV's published counts are in the table of DeepSeek's
    DualPipe repository, github.com/deepseek-ai/DualPipe, README, not in DeepSeek-V3's
    report, whose Table 2 has DualPipe only; the repository credits DualPipeV, DualPipe
    cut in half, to Sea AI Lab. That table counts stages of 1/PP of the model, "based on
    the same number of PP stages", and DualPipeV holds 2 of them on each of PP/2 ranks:
    its "2x" parameters are 1 stage here, its PP + 1 activations (PP + 1)/2 here.)
    """

    rank: int
    busy: float          # time computing
    bubble: float        # idle time in the step: makespan - busy
    gaps: float          # idle time between this rank's first start and last end
    activations: float   # peak, in stage-micro-batches
    parameters: float    # stages held
    messages: int        # activations and gradients sent to other ranks per step


def rank_facts(schedule: Schedule, timeline: Timeline) -> list[RankFacts]:
    """Per rank: bubble, peak activations, parameters and messages of ``schedule`` in
    ``timeline`` (simulated, with whatever ``comm`` it was given, or measured). ``gaps``
    is the bubble left when consecutive steps overlap, as Qi et al.'s ZB-H2 lets them
    (its optimizer step does not wait for every rank): the fill and drain at the edges
    then cost nothing."""
    S, p = schedule.stages, schedule.ranks
    if timeline.ranks != p:
        raise ValueError(f"the timeline has {timeline.ranks} ranks, the schedule {p}: give "
                         f"the timeline of one pipeline (one replica) of {schedule.name}")
    peaks = timeline.peak_activations([p / S] * S)
    busy, span = timeline.busy(), timeline.makespan
    first, last = [math.inf] * p, [-math.inf] * p
    for e in timeline.events:
        first[e.rank], last[e.rank] = min(first[e.rank], e.start), max(last[e.rank], e.end)
    facts = []
    for r in range(p):
        own_span = max(last[r] - first[r], 0.0)
        sends = sum(1 for a in schedule.actions[r] if (d := destination(a, S)) is not None
                    and schedule.rank_of(d) != r)
        facts.append(RankFacts(r, busy[r], span - busy[r], own_span - busy[r], peaks[r],
                               len(schedule.stages_on(r)) * p / S, sends))
    return facts


def summary(schedule: Schedule, timeline: Timeline) -> dict:
    """One row of a table that compares schedules: the step's makespan and bubble share,
    and the worst rank's bubble, peak activations and parameters (`RankFacts` units), and
    the messages of the whole step."""
    facts = rank_facts(schedule, timeline)
    return {"schedule": schedule.name, "ranks": schedule.ranks,
            "microbatches": schedule.microbatches, "makespan": timeline.makespan,
            "bubble_fraction": timeline.bubble_fraction(),
            "bubble": max(f.bubble for f in facts),
            "activations": max(f.activations for f in facts),
            "parameters": max(f.parameters for f in facts),
            "messages": sum(f.messages for f in facts)}


def simulate_measured(schedule: Schedule, timeline: Timeline) -> Timeline:
    """The simulator fed this run's mean time per (stage, action kind): what the schedule
    would do on these stages with free communication and no overhead. Its bubble is the
    one a measured run should approach. A stage that splits its backwards is simulated
    with B = I + W, also for the micro-batches it does not split (DualPipeV)."""
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in timeline.events:
        durations[(e.action.stage, e.action.kind)].append(e.duration)

    def mean(stage: int, kind: str) -> float | None:
        d = durations[(stage, kind)]
        return sum(d) / len(d) if d else None

    forward, backward, weight = [], [], []
    for s in range(schedule.stages):
        f, b, i, w = (mean(s, kind) for kind in "FBIW")
        if f is None or (b is None and (i is None or w is None)):
            raise ValueError(f"the timeline has no forward or no backward on stage {s}: it "
                             f"is not a run of {schedule.name} with {schedule.stages} stages")
        split = i is not None and w is not None
        forward.append(f)
        backward.append(i + w if split else b)
        weight.append(w if split else b / 2)
    simulated = simulate(schedule, forward, backward, weight)
    simulated.unit = timeline.unit   # the costs were measured in the timeline's unit
    return simulated
