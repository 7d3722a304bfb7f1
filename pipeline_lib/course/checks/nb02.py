"""Checks of notebook 02's exercises (schedules as data, the stage loop, activation memory).

Each ``check_*`` takes the learner's function and runs it where the library functions that
*are* the answer (the schedule builders, the simulator) are withheld, however the learner
reaches them (``BUILDERS["gpipe"]`` included), then judges what it returned with
`validate`, the simulator and real training steps on a tiny model, at the notebook's sizes
and at sizes drawn afresh for every run (`hidden_cases`): a table of schedules or numbers
copied from a message fails on the next run. The stage
loop's check also watches the order in which each stage ran its actions: gradients alone
cannot tell a loop that follows its program from one that runs all forwards, then all
backwards, or that runs an I as a whole B.
"""
from __future__ import annotations

import copy
import numbers
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)
from pipeline_lib.microbatch import loss_weights, split
from pipeline_lib.schedules import (BUILDERS, Action, Schedule, ScheduleError, build,
                                    gpipe, interleaved_1f1b, one_f_one_b,
                                    one_forward_one_backward, rounds, validate, zb_h1)
from pipeline_lib.stage import StageRunner
from pipeline_lib.threaded import Pipe
from pipeline_lib.timeline import Timeline, simulate

# what computes a schedule for the learner: every builder, and PyTorch's lists; 2.5 may
# use 1F1B's building block, which 2.1 and 2.2 ask the learner to write
BUILDER_FUNCTIONS = (*BUILDERS.values(), build, rounds, "pipeline_lib.course.pytorch_schedules")
WITH_BLOCK = (*BUILDER_FUNCTIONS, one_forward_one_backward)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


def schedule_problem(schedule: Any, call: str, p: int, m: int, v: int = 1) -> str:
    """What is wrong with `schedule` as the answer of ``call``; "" if it is a valid one."""
    if not isinstance(schedule, Schedule):
        return f"{call} must return a Schedule, got {type(schedule).__name__}"
    if (schedule.ranks, schedule.microbatches, schedule.virtual_stages) != (p, m, v):
        return (f"{call} is for ranks={schedule.ranks}, microbatches={schedule.microbatches}, "
                f"virtual_stages={schedule.virtual_stages}; expected {p}, {m} and {v}")
    try:
        validate(schedule)
    except ScheduleError as error:
        return f"{call} is not a schedule that can run: {error}"
    return ""


def differences_from_unpipelined(run: Callable, p: int = 3) -> str:
    """Train a tiny p-stage model on 10 rows with ``run(model, x, y)`` (it returns the
    loss) and say how its loss and gradients differ from the unpipelined model's; "" if
    they do not."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(p)])
    unpipelined = copy.deepcopy(model)
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    expected = nn.functional.mse_loss(unpipelined(x), y)
    expected.backward()
    loss = run(model, x, y)
    if not torch.allclose(torch.as_tensor(loss, dtype=expected.dtype), expected, rtol=1e-5):
        return f"the loss is {float(loss):.6f}, the unpipelined model's {expected.item():.6f}"
    for s, (stage, reference) in enumerate(zip(model, unpipelined)):
        for (name, mine), theirs in zip(stage.named_parameters(), reference.parameters()):
            if mine.grad is None:
                return f"stage {s}'s {name} got no gradient"
            if not torch.allclose(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6):
                return f"stage {s}'s {name} gradient differs from the unpipelined model's"
    return ""


def on_pipe(schedule: Schedule) -> Callable:
    """``run`` for `differences_from_unpipelined`: one `Pipe.step` under ``schedule``."""
    return lambda model, x, y: Pipe(model, chunks=schedule.microbatches, checkpoint="never"
                                    ).step(x, y, nn.functional.mse_loss, schedule)


def _by_hand(builder: Callable, call: str, p: int, m: int, v: int | None = None) -> Schedule:
    with withheld(*(BUILDER_FUNCTIONS if v else WITH_BLOCK)):
        schedule = builder(p, m) if v is None else builder(p, m, v)
    problem = schedule_problem(schedule, call, p, m, v or 1)
    _require(not problem, problem)
    return schedule


def _sizes(rng: Any) -> tuple[int, int]:
    """Ranks and micro-batches for a drawn case."""
    return rng.randint(2, 6), rng.randint(1, 12)


@ignores_namespace(1)
def check_gpipe(gpipe_by_hand: Callable) -> None:
    """Exercise 2.1: GPipe's bubble and memory, at the notebook's sizes and at sizes drawn
    for this run; trains like the unsplit model."""
    shown = [(1, 1), (2, 3), (3, 4), (4, 8)]
    for p, m in shown + hidden_cases(_sizes, 3, shown=shown):
        call = f"gpipe_by_hand({p}, {m})"
        timeline = simulate(_by_hand(gpipe_by_hand, call, p, m))
        bubble, theory = timeline.bubble_fraction(), (p - 1) / (m + p - 1)
        _require(abs(bubble - theory) < 1e-9,
                 f"{call}: simulated bubble {bubble:.4f}, but GPipe's is (p-1)/(m+p-1) = "
                 f"{theory:.4f}; a rank must start its next forward as soon as it can, and "
                 f"its backwards only after its last forward")
        peak = timeline.peak_in_flight()
        _require(peak == [m] * p,
                 f"{call}: peak in-flight micro-batches per rank {peak}, expected {[m] * p}: "
                 f"GPipe runs every forward before any backward, so each stage holds all m "
                 f"micro-batches")
    schedule = _by_hand(gpipe_by_hand, "gpipe_by_hand(3, 4)", 3, 4)
    gap = differences_from_unpipelined(on_pipe(schedule))
    _require(not gap, f"Pipe.step with gpipe_by_hand(3, 4): {gap}")


@ignores_namespace(1)
def check_one_f_one_b(one_f_one_b_by_hand: Callable) -> None:
    """Exercise 2.2: GPipe's bubble at no more than 1F1B's micro-batches in flight, at the
    notebook's sizes and at sizes drawn for this run."""
    shown = [(1, 2), (2, 5), (3, 4), (4, 8), (4, 2)]
    for p, m in shown + hidden_cases(_sizes, 3, shown=shown):
        call = f"one_f_one_b_by_hand({p}, {m})"
        timeline = simulate(_by_hand(one_f_one_b_by_hand, call, p, m))
        bubble, theory = timeline.bubble_fraction(), (p - 1) / (m + p - 1)
        _require(abs(bubble - theory) < 1e-9,
                 f"{call}: simulated bubble {bubble:.4f}, but 1F1B's is GPipe's, "
                 f"(p-1)/(m+p-1) = {theory:.4f}: stage s must keep enough micro-batches in "
                 f"flight to stay busy until its first gradient comes back")
        peak, expected = timeline.peak_in_flight(), one_f_one_b(p, m)
        most = simulate(expected).peak_in_flight()
        _require(all(a <= b for a, b in zip(peak, most)),
                 f"{call}: peak in-flight micro-batches per rank {peak}; 1F1B holds {most} "
                 f"(GPipe holds m = {m} on every rank): run a backward as soon as one is "
                 f"due, before the next forward")
    schedule = _by_hand(one_f_one_b_by_hand, "one_f_one_b_by_hand(3, 4)", 3, 4)
    gap = differences_from_unpipelined(on_pipe(schedule))
    _require(not gap, f"Pipe.step with one_f_one_b_by_hand(3, 4): {gap}")


class Mail:
    """Messages between ``stages`` stage threads, by key: `put` never waits; `get` waits
    for its key. A message nobody can send any more is an error, not a hang: when every
    stage thread is waiting in `get` or has ended (`finished`), none of the missing
    messages can come, and `get` raises `TimeoutError` at once, naming its key; so does a
    wait longer than ``patience`` seconds. A slow machine never makes a right loop fail."""

    # a key that does not name its receiver lets one stage take another's message
    TAKEN = " (or another stage took it: keys must name the receiving stage)"

    def __init__(self, stages: int, patience: float = 60.0):
        self.stages, self.patience = stages, patience
        self.cond = threading.Condition()
        self.boxes: dict[Any, list[Any]] = defaultdict(list)
        self.wanted: dict[int, Any] = {}      # thread -> the key it waits for
        self.ended = 0

    def put(self, key: Any, value: Any) -> None:
        with self.cond:
            self.boxes[key].append(value)
            self.cond.notify_all()

    def finished(self) -> None:
        """A stage thread ended (it sends nothing more)."""
        with self.cond:
            self.ended += 1
            self.cond.notify_all()

    def _stuck(self) -> bool:
        """Whether no stage can send anything more: each has ended, or waits for a key
        with nothing in its box."""
        blocked = sum(1 for wanted in self.wanted.values() if not self.boxes[wanted])
        return blocked + self.ended >= self.stages

    def get(self, key: Any) -> Any:
        deadline, me = time.monotonic() + self.patience, threading.get_ident()
        with self.cond:
            self.wanted[me] = key
            try:
                while not self.boxes[key]:
                    if self._stuck():
                        raise TimeoutError(f"every stage is waiting for a message or has "
                                           f"ended, so the message with key {key!r}, which "
                                           f"this stage waits for, will never come: no "
                                           f"stage sent it{self.TAKEN}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"waited {self.patience:g} s for a message with "
                                           f"key {key!r}, which no stage sent{self.TAKEN}")
                    self.cond.wait(left)
                return self.boxes[key].pop(0)
            finally:
                del self.wanted[me]
                self.cond.notify_all()


class _Watched:
    """A `StageRunner` that writes down each action it runs, in order."""

    def __init__(self, runner: StageRunner):
        self.runner, self.ran = runner, []

    def forward(self, i: int, x: Any, target: Any = None) -> Any:
        self.ran.append(Action(self.runner.stage, "F", i))
        return self.runner.forward(i, x, target)

    def backward(self, i: int, grad: Any = None) -> Any:
        self.ran.append(Action(self.runner.stage, "B", i))
        return self.runner.backward(i, grad)

    def backward_input(self, i: int, grad: Any = None) -> Any:
        self.ran.append(Action(self.runner.stage, "I", i))
        return self.runner.backward_input(i, grad)

    def backward_weight(self, i: int) -> None:
        self.ran.append(Action(self.runner.stage, "W", i))
        if i not in self.runner.pending_weight:     # the runner would raise KeyError: i
            raise ExerciseFailed(f"stage {self.runner.stage} ran the W of micro-batch {i} "
                                 f"without its I (was I run as a whole B?)")
        self.runner.backward_weight(i)


def run_stage_threads(loop: Callable, schedule: Schedule,
                      ran: list[list[Action]] | None = None) -> Callable:
    """``run`` for `differences_from_unpipelined`: what `Pipe.step` does, with ``loop`` as
    each stage thread's body (one `StageRunner` and one thread per stage). Each stage's
    actions, in the order it ran them, are appended to ``ran`` if given."""
    def run(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p, m = schedule.ranks, schedule.microbatches
        inputs, targets = split(x, m), split(y, m)
        runners = [StageRunner(s, model[s], torch.device("cpu"), "never", m, step_seed=0,
                               loss_fn=nn.functional.mse_loss if s == p - 1 else None,
                               loss_weights=loss_weights(targets), input_as_given=s == 0)
                   for s in range(p)]
        watched = [_Watched(runner) for runner in runners]
        mail, errors = Mail(p), []

        def thread(s: int) -> None:
            try:
                loop(watched[s], schedule.actions[s], mail, p, inputs, targets)
            except Exception as error:
                errors.append(error)
            finally:
                mail.finished()

        threads = [threading.Thread(target=thread, args=(s,)) for s in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if ran is not None:
            ran.extend(w.ran for w in watched)
        if errors:   # the first error that is not a stage waiting for the failed one
            raise next((e for e in errors if not isinstance(e, TimeoutError)), errors[0])
        missing = [i for i in range(m) if i not in runners[-1].losses]
        if missing:
            raise ExerciseFailed(f"the last stage computed no loss for micro-batches "
                                 f"{missing}: run every action of the program")
        return sum(runners[-1].losses[i][0] for i in range(m))
    return run


@ignores_namespace(1)
def check_stage_loop(stage_loop: Callable) -> None:
    """Exercise 2.3: every stage runs its program's actions, in its order, and the tiny
    model trains as unpipelined, under GPipe, 1F1B and ZB-H1 (I and W) on 3 stages, and
    under a schedule of a size drawn for this run."""
    drawn = hidden_cases(lambda rng: (rng.choice(["1f1b", "zb_h1", "gpipe"]),
                                      rng.randint(2, 4), rng.randint(2, 6)), 1,
                         shown=[("gpipe", 3, 4), ("1f1b", 3, 4), ("zb_h1", 3, 4)])
    schedules = [gpipe(3, 4), one_f_one_b(3, 4), zb_h1(3, 4)]
    schedules += [build(name, p, m) for name, p, m in drawn]
    for schedule in schedules:
        ran: list[list[Action]] = []
        with withheld("pipeline_lib.threaded", "pipeline_lib.executor"):
            gap = differences_from_unpipelined(run_stage_threads(stage_loop, schedule, ran),
                                               p=schedule.ranks)
        for s, (mine, program) in enumerate(zip(ran, schedule.actions)):
            _require(mine == list(program),
                     f"{schedule.name} (p = {schedule.ranks}, m = {schedule.microbatches}): "
                     f"stage {s} ran {' '.join(map(str, mine)) or 'nothing'}, "
                     f"but its program is {' '.join(map(str, program))}: run the program's "
                     f"actions in its order, each with the runner method of its kind (I is "
                     f"backward_input, W backward_weight)")
        _require(not gap, f"{schedule.name} run by your stage_loop: {gap}")


PEAK_CASES = [(interleaved_1f1b, 4, 8, 2), (interleaved_1f1b, 4, 6, 2),
              (interleaved_1f1b, 3, 6, 3), (one_f_one_b, 4, 8, 1), (gpipe, 3, 4, 1),
              (zb_h1, 4, 8, 1)]


def _program_case(rng: Any) -> tuple[str, int, int, int]:
    name = rng.choice(["interleaved_1f1b", "interleaved_zero_bubble", "looped_bfs", "zb_h2",
                       "zb_v", "1f1b"])
    return name, rng.randint(2, 5), rng.randint(2, 12), rng.randint(2, 3)


@ignores_namespace(1)
def check_peak_held(peak_held: Callable) -> None:
    """Exercise 2.4: every rank's peak, counted from its program, against the simulator, on
    the notebook's schedules and on schedules of kinds and sizes drawn for this run."""
    schedules = [builder(p, m, v) if v > 1 else builder(p, m) for builder, p, m, v in PEAK_CASES]
    schedules += [build(name, p, m, v) for name, p, m, v in hidden_cases(_program_case, 3)]
    for schedule in schedules:
        v, p, m = schedule.virtual_stages, schedule.ranks, schedule.microbatches
        expected = [n / v for n in simulate(schedule).peak_in_flight()]
        for r, program in enumerate(schedule.actions):
            with withheld(simulate, Timeline.peak_in_flight, Timeline.peak_activations,
                          *WITH_BLOCK):
                mine = peak_held(list(program), v)
            _require(isinstance(mine, numbers.Real) and abs(mine - expected[r]) < 1e-9,
                     f"{schedule.name}, p = {p}, m = {m}, v = {v}: for rank {r}'s program "
                     f"peak_held gives {mine!r}, "
                     + (f"{'more' if mine > expected[r] else 'less'} than the simulator's "
                        f"count of held (virtual stage, micro-batch) pairs over v"
                        if isinstance(mine, numbers.Real) else "not a number"))


INTERLEAVED_CASES = [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 12, 2), (2, 2, 2)]
# what a message between ranks costs in 2.5's simulations, in units of a whole stage's
# forward: with free messages a warm-up of one hop per later rank is as fast as two (the
# gradient's trip back is hidden); Megatron's two hops per rank pay off once messages take time
MESSAGE_TIME = 0.1


@ignores_namespace(1)
def check_interleaved(interleaved_by_hand: Callable) -> None:
    """Exercise 2.5: a valid interleaved 1F1B, as short as the library's at no more
    memory on any rank (simulated with messages that take time), at the notebook's sizes
    and at sizes drawn for this run, that trains like the unsplit model."""
    drawn = hidden_cases(lambda rng: (p := rng.randint(2, 5), p * rng.randint(1, 4),
                                      rng.randint(2, 3)), 3, shown=INTERLEAVED_CASES)
    for p, m, v in INTERLEAVED_CASES + drawn:
        call = f"interleaved_by_hand({p}, {m}, {v})"
        mine = _by_hand(interleaved_by_hand, call, p, m, v)
        kinds = {a.kind for program in mine.actions for a in program}
        _require(kinds == {"F", "B"}, f"{call}: use forwards and whole backwards (F and B); "
                                      f"your schedule has kinds {sorted(kinds)}")
        costs = dict(forward=1 / v, backward=2 / v, comm=MESSAGE_TIME)
        t, target = simulate(mine, **costs), simulate(interleaved_1f1b(p, m, v), **costs)
        held, most = t.peak_in_flight(), target.peak_in_flight()
        over = [r for r, (a, b) in enumerate(zip(held, most)) if a > b]
        _require(not over,
                 f"{call}: your ranks hold {held} (virtual stage, micro-batch) pairs at "
                 f"their peak, more than under interleaved 1F1B on ranks {over}: start the "
                 f"backwards as soon as the first gradient can be back, not after all "
                 f"forwards")
        _require(t.makespan <= target.makespan + 1e-9,
                 f"{call}: your step takes {t.makespan:.4g} cost units (a virtual stage's forward "
                 f"costs 1/v, a message {MESSAGE_TIME}), interleaved 1F1B's "
                 f"{target.makespan:.4g}: a rank that runs out of forwards before its first "
                 f"gradient is back idles: count the hops micro-batch 0's gradient needs to "
                 f"come back")
    schedule = _by_hand(interleaved_by_hand, "interleaved_by_hand(2, 4, 2)", 2, 4, 2)
    gap = differences_from_unpipelined(on_pipe(schedule), p=4)
    _require(not gap, f"Pipe.step with interleaved_by_hand(2, 4, 2): {gap}")
