"""Pipeline schedules as data: an ordered list of actions per rank.

One representation serves everything: the simulator, the Gantt plots, the threaded
executor and the multi-process executor all read the same `Schedule`, so what a notebook
draws is exactly what runs.

Vocabulary
----------
* A *stage* is a contiguous slice of the model. A rank (device) may hold several stages
  (*virtual stages*, ``virtual_stages`` per rank; PyTorch and Megatron call them model
  chunks): looped schedules put stage ``s`` on rank ``s % ranks`` (interleaved 1F1B);
  V-shaped ones go down the ranks and back up, stage ``s`` on rank ``s`` for ``s < ranks``
  and on rank ``2·ranks - 1 - s`` after (ZB-V, DualPipeV). `Schedule.rank_of` says which.
* An *action* is one unit of work of one micro-batch on one stage:
  ``F`` forward, ``B`` full backward, or the two halves of a split backward used by the
  zero-bubble schedules: ``I`` (gradient w.r.t. the stage input, which the previous stage
  is waiting for) and ``W`` (gradient w.r.t. the weights, which nobody waits for).
  Each (stage, micro-batch) gets one F and either one B or an I and a W.
* Written ``{stage}{kind}{microbatch}``: ``0F1`` is the forward of micro-batch 1 on stage 0.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Callable, Iterator, Literal, NamedTuple, Sequence

from pipeline_lib.deprecation import renamed_keywords

Kind = Literal["F", "B", "I", "W"]
KINDS = ("F", "B", "I", "W")


class Action(NamedTuple):
    """A tuple, so that the simulator and `validate`, which hash hundreds of thousands of
    them for a large pipeline, stay fast."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass
class Schedule:
    """Which action each rank runs, in order. ``actions[r]`` is rank ``r``'s program.

    ``placement[s]`` is the rank holding stage ``s``; None means looped, ``s % ranks``.
    """

    name: str
    ranks: int
    microbatches: int
    actions: list[list[Action]]
    virtual_stages: int = 1
    meta: dict = field(default_factory=dict)
    placement: tuple[int, ...] | None = None

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks if self.placement is None else self.placement[stage]

    def stages_on(self, rank: int) -> list[int]:
        return [s for s in range(self.stages) if self.rank_of(s) == rank]

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

    # PyTorch's notation: see pipeline_lib.pytorch.notation, which these delegate to.

    def to_pytorch(self, overlap: bool = True) -> list[list[str]]:
        """Per rank, the program in PyTorch's notation (``["0F0", "0F1", "0B0", ...]``);
        DualPipeV's F&B pairs as ``(0F7;7B3)OVERLAP_F_B`` unless ``overlap`` is False."""
        from pipeline_lib.pytorch.notation import to_pytorch
        return to_pytorch(self, overlap)

    def to_csv(self, path: str | Path,
               format: Literal["compute_only", "compute_comms"] = "compute_only",
               overlap: bool = True) -> Path:
        """Write the schedule as a CSV that PyTorch's ``_PipelineScheduleRuntime._load_csv``
        reads with the same ``format``, and torchtitan takes as its
        ``pipeline_parallel_schedule_csv`` (``compute_only``); ``compute_comms`` adds the
        sends and receives of our lowering."""
        from pipeline_lib.pytorch.notation import to_csv
        return to_csv(self, path, format, overlap)

    @classmethod
    def from_csv(cls, path: str | Path, name: str | None = None,
                 microbatches: int | None = None) -> "Schedule":
        """A schedule CSV in PyTorch's notation (``compute_only`` or ``compute_comms``,
        from PyTorch, torchtitan or by hand) as a validated `Schedule`."""
        from pipeline_lib.pytorch.notation import from_csv
        return from_csv(path, name, microbatches)


def v_shape(ranks: int) -> tuple[int, ...]:
    """The placement of a V: stages 0..p-1 down ranks 0..p-1, stages p..2p-1 back up.
    The first and last stages share rank 0, and the turn (stages p-1, p) needs no message."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


# ---------------------------------------------------------------------------------------
# Builders. Each fits on a screen; the tests `validate` every one over a grid of sizes.
# ---------------------------------------------------------------------------------------

def _check_sizes(ranks: int, microbatches: int) -> None:
    if not (_is_count(ranks) and _is_count(microbatches)):
        raise TypeError(f"ranks and microbatches must be ints, got ranks={ranks!r}, "
                        f"microbatches={microbatches!r}")
    if ranks < 1 or microbatches < 1:
        raise ValueError(f"need ranks >= 1 and microbatches >= 1, got ranks={ranks}, "
                         f"microbatches={microbatches}")


@renamed_keywords(stages="ranks")
def gpipe(ranks: int, microbatches: int) -> Schedule:
    """Fill-drain: every forward, then every backward. Simple, holds all m activations."""
    _check_sizes(ranks, microbatches)
    m = range(microbatches)
    actions = [[Action(s, "F", i) for i in m] + [Action(s, "B", i) for i in m]
               for s in range(ranks)]
    return Schedule("GPipe", ranks, microbatches, actions)


Unit = tuple[int, int]   # (stage, micro-batch)


def one_forward_one_backward(forwards: Sequence[Unit], backwards: Sequence[Unit],
                             ahead: int, weight_lag: int | None = None) -> list[Action]:
    """One rank's program in the 1F1B family: ``ahead`` forwards, then one backward, one
    forward, one backward... until both lists are done.

    ``ahead`` is how many micro-batches the rank keeps in flight: 1F1B's stage ``s`` runs
    ``p - s``, just enough to be busy until the first gradient comes back; GPipe would be
    ``ahead = m``. With ``weight_lag``, each backward is split: its I runs at once (the
    previous stage waits for it) and its W ``weight_lag`` backwards later, where the rank
    would otherwise wait; the lagging Ws close the program.
    """
    ahead = min(ahead, len(forwards))
    program = [Action(s, "F", i) for s, i in forwards[:ahead]]
    for k, (s, i) in enumerate(backwards):
        if weight_lag is None:
            program.append(Action(s, "B", i))
        else:
            program.append(Action(s, "I", i))
            if k >= weight_lag:
                program.append(Action(backwards[k - weight_lag][0], "W",
                                      backwards[k - weight_lag][1]))
        if ahead + k < len(forwards):
            program.append(Action(forwards[ahead + k][0], "F", forwards[ahead + k][1]))
    if weight_lag is not None:
        program += [Action(s, "W", i) for s, i in backwards[max(len(backwards) - weight_lag, 0):]]
    return program


@renamed_keywords(stages="ranks")
def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B: after a short warm-up each rank alternates one forward and one backward.

    Same bubble as GPipe, but stage ``s`` never holds more than ``min(ranks - s, m)``
    micro-batches' activations instead of all ``m``.
    """
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    mine = [[(s, i) for i in range(m)] for s in range(p)]
    return Schedule("1F1B", p, m, [one_forward_one_backward(mine[s], mine[s], ahead=p - s)
                                   for s in range(p)])


@renamed_keywords(stages="ranks")
def zb_h1(ranks: int, microbatches: int) -> Schedule:
    """Zero-bubble H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024;
    arXiv 2401.10241, January 2024): 1F1B with each backward split into ``I`` (input
    gradient, which the previous stage waits for) and ``W`` (weight gradient, which
    nobody waits for).

    Input gradients travel back sooner, and stage ``s`` runs each ``W`` ``s``
    micro-batches late, so the deferred ``W`` fill the drain bubble: with F = I = W the
    bubble falls from 1F1B's (p-1)·3F to (p-1)·F. Every stage then holds up to ``p``
    micro-batches, which is 1F1B's peak (on stage 0): the same peak memory.
    """
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    mine = [[(s, i) for i in range(m)] for s in range(p)]
    return Schedule("ZB-H1", p, m, [one_forward_one_backward(mine[s], mine[s], ahead=p - s,
                                                             weight_lag=s) for s in range(p)])


@renamed_keywords(stages="ranks")
def zb_h2(ranks: int, microbatches: int) -> Schedule:
    """Zero-bubble H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; arXiv
    2401.10241, January 2024): ZB-H1 with more forwards in flight.

    Stage ``s`` runs ``2(p - s) - 1`` forwards before its first I (1F1B: ``p - s``): enough
    to stay busy until that gradient arrives, which takes ``2(p - 1 - s)`` more steps at
    F = I = W. Its Ws lag ``2s`` backwards, so the stages close the step as they opened it,
    one step apart: no rank idles between its first and last action (a parallelogram),
    at a price of ``2p - 1`` micro-batches of activations on every stage.
    """
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    mine = [[(s, i) for i in range(m)] for s in range(p)]
    return Schedule("ZB-H2", p, m, [one_forward_one_backward(
        mine[s], mine[s], ahead=2 * (p - s) - 1, weight_lag=2 * s) for s in range(p)])


def rounds(ranks: int, microbatches: int) -> list[range]:
    """Groups of consecutive micro-batches that go through all of a rank's virtual stages together
    (interleaved schedules). As in PyTorch, ``max(1, m // p)`` groups, each at least ``p``
    (one per rank, so the pipeline fills) unless ``m < p``; where PyTorch refuses an ``m``
    that the groups do not divide, the first ``m % groups`` groups take one more."""
    count = max(1, microbatches // ranks)
    size, extra = divmod(microbatches, count)
    starts = [g * size + min(g, extra) for g in range(count + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def _looped(name: str, ranks: int, microbatches: int, virtual_stages: int,
            ahead: Callable[[int, int], int], weight_lag: Callable[[int], int] | None = None,
            in_rounds: bool = True) -> Schedule:
    """A looped schedule: rank ``r`` holds stages ``r, r + p, r + 2p, ...``. Its forwards go
    round by round (`rounds`, or all m at once), virtual stage after virtual stage; its
    backwards the same, in reverse. ``ahead(r, first round's size)`` and ``weight_lag(r)`` as in
    `one_forward_one_backward`."""
    _check_sizes(ranks, microbatches)
    p, m, v = ranks, microbatches, virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}")
    groups = rounds(p, m) if in_rounds else [range(m)]
    actions = []
    for r in range(p):
        forwards = [(c * p + r, i) for g in groups for c in range(v) for i in g]
        backwards = [(c * p + r, i) for g in groups for c in reversed(range(v)) for i in g]
        actions.append(one_forward_one_backward(
            forwards, backwards, ahead(r, len(groups[0])),
            None if weight_lag is None else weight_lag(r)))
    return Schedule(f"{name} (v={v})", p, m, actions, virtual_stages=v)


@renamed_keywords(stages="ranks")
def interleaved_1f1b(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: each of ``ranks`` ranks holds ``virtual_stages``
    stages (Megatron's model chunks; stage ``c * ranks + r`` on rank ``r``), so a
    micro-batch visits every rank ``virtual_stages`` times in smaller steps and the
    fill/drain bubble shrinks by that factor.

    Micro-batches go through in `rounds` of at least ``ranks`` (any ``m`` works; a round
    of ``g`` micro-batches runs on virtual stage 0, then 1...). Rank ``r`` runs the whole
    first round through all but its last virtual stage, and ``2(p - 1 - r)`` forwards more, before
    its first backward: that is when the first gradient can be back.
    """
    p, v = ranks, virtual_stages
    return _looped("Interleaved 1F1B", p, microbatches, v,
                   ahead=lambda r, g: (v - 1) * g + 2 * (p - 1 - r) + 1)


@renamed_keywords(stages="ranks")
def interleaved_zero_bubble(ranks: int, microbatches: int,
                            virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B with split backwards, as PyTorch's ScheduleInterleavedZeroBubble:
    an I returns sooner than a B, so rank ``r`` keeps only ``p - 1 - r`` extra forwards in
    flight (not ``2(p - 1 - r)``), and runs each W ``r`` backwards late, in the gaps."""
    p, v = ranks, virtual_stages
    return _looped("Interleaved zero bubble", p, microbatches, v,
                   ahead=lambda r, g: (v - 1) * g + (p - 1 - r) + 1, weight_lag=lambda r: r)


@renamed_keywords(stages="ranks")
def looped_bfs(ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Breadth-first looped schedule (Lamy-Poirier, 2022): each rank runs all micro-batches
    through its first virtual stage, then its second..., then all backwards, last first.
    GPipe on a loop: the fill costs a virtual stage, not a rank's stages, but all m stay
    in flight. (PyTorch's runs each virtual stage's backwards last micro-batch first: the
    same times.)"""
    return _looped("Looped BFS", ranks, microbatches, virtual_stages,
                   ahead=lambda r, g: microbatches * virtual_stages, in_rounds=False)


class _Program:
    """One rank's program, written by naming a stage and kinds: each (stage, kind) takes
    its micro-batches in order, so a builder only decides how the rank interleaves them.
    A B and an I share the count of a stage's backwards. ``weight()`` runs the W of the
    oldest I still without one (of ``stage`` if given)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: Counter[tuple[int, str]] = Counter()
        self.waiting_weights: list[tuple[int, int]] = []
        self.overlapped: list[tuple[Action, Action]] = []

    def overlap(self, forward: int, backward: int) -> None:
        """A forward of stage ``forward``, then a full backward of stage ``backward``,
        recorded as a pair the two may overlap (DualPipeV's F&B)."""
        self.add(forward, "F")
        self.add(backward, "B")
        self.overlapped.append((self.actions[-2], self.actions[-1]))

    def add(self, stage: int, *kinds: str) -> None:
        for kind in kinds:
            if kind == "W":
                self.weight(stage)
                continue
            key = (stage, "B" if kind == "I" else kind)
            self.actions.append(Action(stage, kind, self.count[key]))
            if kind == "I":
                self.waiting_weights.append((stage, self.count[key]))
            self.count[key] += 1

    def weight(self, stage: int | None = None) -> bool:
        mine = [w for w in self.waiting_weights if stage is None or w[0] == stage]
        if mine:
            self.waiting_weights.remove(mine[0])
            self.actions.append(Action(mine[0][0], "W", mine[0][1]))
        return bool(mine)

    def done(self, stage: int, kind: str) -> int:
        """How many ``kind`` (F or B, which counts the Is too) ``stage`` has run."""
        return self.count[(stage, "B" if kind == "I" else kind)]


def _first(programs: list[list[Action]], microbatches: int) -> list[list[Action]]:
    """The programs without micro-batches past the first ``microbatches``. A builder whose
    pattern needs more fills it and drops the extras: each dropped action is only
    ever waited for by actions of its own micro-batch, so the rest stays valid."""
    return [[a for a in program if a.microbatch < microbatches] for program in programs]


def zb_v(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., 2024): split backwards, two virtual stages per rank in a V
    (`v_shape`).

    Rank ``r`` holds stage ``r`` on the way down and ``2p - 1 - r`` on the way up. The
    turn at the bottom is free (rank ``p - 1`` holds both stages), and the way up's
    gradients start back as soon as the forwards reach the bottom: with F = I = W per
    virtual stage and m >= 2p - 1, no rank idles between its first and last action, at 1F1B's
    peak of ``p`` micro-batches of a whole stage (``2p`` of half a stage).
    """
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    n = max(m, 2 * p - 1)    # the pattern needs 2p - 1 micro-batches to fill the V
    programs = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        prog = _Program()
        for _ in range(2 * (p - r) - 1):                     # fill the way down
            prog.add(down, "F")
        for _ in range(r):                                   # both virtual stages, forward
            prog.add(up, "F")
            prog.add(down, "F")
        for _ in range(p - r):                               # first gradients on the way up
            prog.add(up, "F", "I", "W")
        while prog.done(down, "F") < n or prog.done(up, "F") < n:   # steady state
            if prog.done(down, "F") < n:
                prog.add(down, "F")
            prog.add(down, "I", "W")
            prog.add(up, "F", "I", "W")
        for _ in range(r):                                   # drain: inputs first
            prog.add(down, "I")
            prog.add(up, "I")
        for _ in range(p - r):
            prog.add(down, "I", "W")
        for stage in (up, down):                             # the weights that waited
            while prog.weight(stage):
                pass
        programs.append(prog.actions)
    return Schedule("ZB-V", p, m, _first(programs, m), virtual_stages=2, placement=v_shape(p))


def dualpipe_v(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV: DualPipe cut in half, two virtual stages per rank in a V.

    DualPipe is DeepSeek-V3's (technical report, arXiv 2412.19437): two copies of the
    model fed from both ends. Its "cut-in-half" version on half as many ranks, DualPipeV,
    is credited in DeepSeek's DualPipe repository (github.com/deepseek-ai/DualPipe,
    README) to Sea AI Lab. The steady state pairs a forward of one virtual stage with a
    full backward of the other (``F&B``); DualPipe overlaps the two so that one's
    communication hides under the other's compute. Our executors run one action at a time,
    so a pair is an F, then a B; the pairs are kept in ``meta["overlapped"]``, which
    `to_pytorch` writes as PyTorch's overlapped steps. The start fills the V with split
    backwards (I, then the W at once); the end splits the backwards again and runs the Ws
    where the rank would otherwise wait.
    """
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    n = max(m, 2 * p)        # the pattern needs a micro-batch per stage
    programs, pairs = [], []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        prog = _Program()
        for _ in range(2 * (p - 1 - r)):                     # 1: fill the way down
            prog.add(down, "F")
        for _ in range(r + 1):                               # 2: both virtual stages, forward
            prog.add(down, "F")
            prog.add(up, "F")
        for _ in range(p - 1 - r):                           # 3: zero-bubble turn
            prog.add(up, "I")
            prog.weight()
            prog.add(up, "F")
        for i in range(n - 2 * p + r + 1):                   # 4: F&B pairs, both ways
            if i == 0 and r == p - 1:     # the bottom's first: nothing to hide yet
                prog.add(down, "F")
                prog.add(up, "B")
            else:
                prog.overlap(down, up)
            prog.overlap(up, down)
        for _ in range(p - 1 - r):                           # 5: no forwards left down
            prog.add(up, "B")
            prog.overlap(up, down)
        split = False                                        # 6: backwards, then split
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            prog.add(up, "I" if split else "B")
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            prog.add(down, "I" if split else "B")
        for _ in range(p - 1 - r):                           # 7: a waiting W, a backward
            prog.weight()
            prog.add(down, "I" if split else "B")
        while prog.weight():                                 # 8: the rest of the Ws
            pass
        programs.append(prog.actions)
        pairs += [pair for pair in prog.overlapped if max(a.microbatch for a in pair) < m]
    return Schedule("DualPipeV", p, m, _first(programs, m), virtual_stages=2,
                    placement=v_shape(p), meta={"overlapped": pairs} if pairs else {})


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "interleaved_1f1b": interleaved_1f1b,
    "interleaved_zero_bubble": interleaved_zero_bubble,
    "looped_bfs": looped_bfs,
    "zb_v": zb_v,
    "dualpipe_v": dualpipe_v,
}
LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs")   # any v per rank
V_SHAPED = ("zb_v", "dualpipe_v")                                          # 2 per rank


@renamed_keywords(stages="ranks")
def build(name: str, ranks: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Look a schedule up by name, as used by `Pipe.step` and the command line, for
    ``ranks`` ranks; looped schedules put ``virtual_stages`` stages on each."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(BUILDERS)} "
                         f"or pass a Schedule object")
    if name in LOOPED:
        return BUILDERS[name](ranks, microbatches, virtual_stages)
    return BUILDERS[name](ranks, microbatches)


def stages_per_rank(name: str, virtual_stages: int = 2) -> int:
    """How many stages the named schedule puts on each rank."""
    if name in V_SHAPED:
        return 2
    return virtual_stages if name in LOOPED else 1


@renamed_keywords(pp="ranks")
def plan(schedule: str | Schedule, ranks: int | None, stages: int,
         microbatches: int) -> Schedule:
    """The schedule for ``stages`` stages on ``ranks`` ranks: built by name (looped
    schedules put ``stages // ranks`` on each rank, V-shaped ones 2), or checked against
    the sizes. ``ranks=None``: as many as the schedule says (a `Schedule`'s own; for a
    name, one stage per rank, or `stages_per_rank` where it runs several)."""
    if ranks is None and isinstance(schedule, Schedule):
        ranks = schedule.ranks
    elif ranks is None:
        per_rank = stages_per_rank(schedule)
        if stages % per_rank:
            raise ValueError(f"{schedule} puts {per_rank} stages on each device, so it needs "
                             f"an even number of stages, not {stages}")
        ranks = stages // per_rank
    if isinstance(schedule, str):
        if schedule in LOOPED and stages % ranks:
            raise ValueError(f"{schedule} puts the same number of stages on every "
                             f"rank: {stages} stages on {ranks} ranks do not divide; give a "
                             f"balance with a multiple of {ranks} entries")
        per_rank = stages // ranks if schedule in LOOPED else stages_per_rank(schedule)
        if schedule in BUILDERS and stages != ranks * per_rank:
            several = "" if per_rank > 1 else \
                f" (or use one of {list(LOOPED + V_SHAPED)} for several stages per rank)"
            raise ValueError(f"{schedule} runs {per_rank} stage(s) per rank: the balance "
                             f"has {stages} stages for {ranks} pipeline ranks; give "
                             f"{ranks * per_rank} entries{several}")
        schedule = build(schedule, ranks, microbatches, per_rank)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name in {sorted(BUILDERS)} or a Schedule, "
                        f"got {type(schedule).__name__}")
    if (schedule.ranks, schedule.stages, schedule.microbatches) != (ranks, stages, microbatches):
        raise ValueError(f"schedule {schedule.name!r} is for {schedule.ranks} ranks, "
                         f"{schedule.stages} stages and {schedule.microbatches} micro-batches, "
                         f"not {ranks} ranks, {stages} stages and {microbatches} micro-batches")
    validate(schedule)
    return schedule


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

class ScheduleError(ValueError):
    """A schedule that is incomplete, breaks a dependency, or would deadlock."""


def dependencies(action: Action, stages: int,
                 split_backward: bool | AbstractSet[tuple[int, int]]) -> list[Action]:
    """The actions whose results `action` consumes.

    F needs the previous stage's F; a backward (B or I) needs its own stage's F and the
    next stage's backward (the last stage instead starts from the loss); W needs the I
    that produced the gradient of the stage output. ``split_backward`` says whose
    backward is split into I and W: every one (True), none (False), or the (stage,
    micro-batch) pairs in a set, as `splits_backward` gives.
    """
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if action.kind in ("B", "I"):
        deps = [Action(s, "F", i)]
        if s < stages - 1:
            split = split_backward if isinstance(split_backward, bool) \
                else (s + 1, i) in split_backward
            deps.append(Action(s + 1, "I" if split else "B", i))
        return deps
    return [Action(s, "I", i)]


def splits_backward(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """The (stage, micro-batch) pairs whose backward is split into I and W: empty (falsy)
    for schedules with full backwards only, all of them for the zero-bubble ones, some
    for DualPipeV."""
    return frozenset((a.stage, a.microbatch) for program in schedule.actions
                     for a in program if a.kind in ("I", "W"))


def destination(action: Action, stages: int) -> int | None:
    """The stage that consumes what `action` produces: the next one for a forward's
    output, the previous one for an input gradient (B or I); None for W and at the ends."""
    if action.kind == "F" and action.stage < stages - 1:
        return action.stage + 1
    if action.kind in ("B", "I") and action.stage > 0:
        return action.stage - 1
    return None


def _check_placement(schedule: Schedule) -> None:
    p, S = schedule.ranks, schedule.stages
    if schedule.placement is None:
        return
    if len(schedule.placement) != S or not all(_is_count(r) and 0 <= r < p
                                               for r in schedule.placement):
        raise ScheduleError(f"{schedule.name}: placement {list(schedule.placement)} must give "
                            f"a rank in 0..{p - 1} for each of the {S} stages")
    idle = [r for r in range(p) if r not in schedule.placement]
    if idle:
        raise ScheduleError(f"{schedule.name}: placement {list(schedule.placement)} gives "
                            f"no stage to ranks {idle}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_shape(schedule: Schedule) -> None:
    """Sizes of at least 1, and one list of actions per rank: what the rest reads."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a Schedule, got {type(schedule).__name__}; build one by "
                        f"name with build(name, ranks, microbatches), e.g. "
                        f"build('1f1b', 4, 8)")
    for name in ("ranks", "microbatches", "virtual_stages"):
        value = getattr(schedule, name)
        if not _is_count(value) or value < 1:
            raise ScheduleError(f"{schedule.name}: {name} is {value!r}; a schedule needs at "
                                f"least 1 (an int): no rank, micro-batch or stage per rank "
                                f"leaves nothing to run")
    if not isinstance(schedule.actions, (list, tuple)) or \
            not all(isinstance(program, (list, tuple)) for program in schedule.actions):
        raise ScheduleError(f"{schedule.name}: actions must be a list holding one list of "
                            f"Actions per rank, got {type(schedule.actions).__name__}")


def _check_actions(schedule: Schedule
                   ) -> tuple[dict[Action, tuple[int, int]], frozenset[tuple[int, int]]]:
    """Each action where it runs, ``(rank, step)``, and `splits_backward`, after checking
    that every (stage, micro-batch) runs one F and one B, or one I and one W, on the rank
    holding the stage."""
    _check_shape(schedule)
    p, S, m = schedule.ranks, schedule.stages, schedule.microbatches
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: has programs for {len(schedule.actions)} "
                            f"ranks, expected {p}")
    _check_placement(schedule)
    owner = [schedule.rank_of(s) for s in range(S)]
    where: dict[Action, tuple[int, int]] = {}
    runs: dict[str, set[tuple[int, int]]] = {kind: set() for kind in KINDS}
    for r, program in enumerate(schedule.actions):
        for step, a in enumerate(program):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r} step {step}: {a!r} is a "
                                    f"{type(a).__name__}, not an Action; write each step as "
                                    f"Action(stage, kind, microbatch), e.g. Action(0, 'F', 0)")
            s, kind, i = a
            if not (_is_count(s) and _is_count(i)):
                raise ScheduleError(f"rank {r} step {step}: {a!r} has stage {s!r} and "
                                    f"micro-batch {i!r}; both must be ints (0-based indices)")
            if kind not in runs:
                raise ScheduleError(f"rank {r} step {step}: unknown action kind {kind!r}")
            if not (0 <= s < S and 0 <= i < m):
                raise ScheduleError(f"rank {r} step {step}: {a} is out of range "
                                    f"(stages 0..{S - 1}, micro-batches 0..{m - 1})")
            if owner[s] != r:
                raise ScheduleError(f"rank {r} step {step}: {a} belongs to stage {s}, "
                                    f"which lives on rank {owner[s]}")
            if a in where:
                raise ScheduleError(f"rank {r} step {step}: {a} (micro-batch {i}"
                                    f" on stage {s}) appears twice")
            where[a] = (r, step)
            runs[kind].add((s, i))
    split = runs["I"] | runs["W"]
    for s, i in sorted(runs["B"] & split):
        r, step = where[Action(s, "B", i)]
        raise ScheduleError(f"rank {r} step {step}: {Action(s, 'B', i)} mixes a full "
                            f"backward B with split I/W backwards of the same "
                            f"micro-batch {i} on stage {s}; use one or the other")
    complete = len(runs["F"]) == len(runs["B"] | split) == S * m and runs["I"] == runs["W"]
    if not complete:
        for s, i in itertools.product(range(S), range(m)):   # find the first gap
            for kind in ["F"] + (["I", "W"] if (s, i) in split else ["B"]):
                if (s, i) not in runs[kind]:
                    what = "B (or I and W)" if kind == "B" and split else kind
                    raise ScheduleError(f"{schedule.name}: stage {s} never runs {what} of "
                                        f"micro-batch {i} (action {Action(s, kind, i)}), on "
                                        f"rank {owner[s]}")
    return where, frozenset(split)


@contextlib.contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector while hundreds of thousands of tuples are made (and
    no cycle): it would otherwise walk all of them again and again, half the time of
    `simulate` at p = 64, m = 1000."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def execution_order(schedule: Schedule) -> list[tuple[int, Action, list[Action]]]:
    """``(rank, action, its dependencies)`` in an order that runs each program in order and
    every action after the ones it depends on; raises `ScheduleError` if there is none.

    Each rank runs until its next action waits for one not yet done, and is woken when
    that one is: every action is looked at a bounded number of times, so this takes time
    linear in the number of actions.
    """
    with cycle_collector_paused():
        return _execution_order(schedule)


def _execution_order(schedule: Schedule) -> list[tuple[int, Action, list[Action]]]:
    where, split = _check_actions(schedule)
    S = schedule.stages
    done: set[Action] = set()
    order: list[tuple[int, Action, list[Action]]] = []
    pc = [0] * schedule.ranks
    waiting: dict[Action, list[int]] = defaultdict(list)   # action -> ranks waiting for it
    ready = list(range(schedule.ranks))
    while ready:
        r = ready.pop()
        program, step = schedule.actions[r], pc[r]
        while step < len(program):
            a = program[step]
            deps = dependencies(a, S, split)
            for d in deps:
                if d not in done:
                    waiting[d].append(r)   # woken when d is done
                    break
            else:
                done.add(a)
                order.append((r, a, deps))
                step += 1
                if a in waiting:
                    ready += waiting.pop(a)
                continue
            break
        pc[r] = step
    stuck = [(r, pc[r], schedule.actions[r][pc[r]]) for r in range(schedule.ranks)
             if pc[r] < len(schedule.actions[r])]
    if stuck:
        lines = []
        for r, step, a in stuck:
            missing = [d for d in dependencies(a, S, split) if d not in done]
            waits = ", ".join(f"{d} (rank {where[d][0]} step {where[d][1]})" for d in missing)
            lines.append(f"rank {r} step {step}: {a} (micro-batch {a.microbatch}, stage "
                         f"{a.stage}) waits for {waits}")
        raise ScheduleError(f"{schedule.name} would deadlock:\n  " + "\n  ".join(lines))
    return order


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` naming the rank, step and micro-batch of the first problem.

    Checks that every (stage, micro-batch) gets exactly one forward and one backward
    (B, or I and W), on the rank that owns the stage, and that running the programs in
    order can never deadlock: an execution in which every rank waits for the actions it
    depends on must finish every program (`execution_order`).
    """
    execution_order(schedule)
