"""Checks of notebook 02b's exercises (the split backward and zero-bubble schedules).

Each ``check_*`` runs the learner's function where the library functions that *are* the
answer are withheld (however reached), at the notebook's cases and at cases drawn afresh
for every run. ZB-H1's bubble is checked at costs beyond W ≤ min(F, I), where the
published formula, printed in notebooks 02 and 02b, no longer holds; the split backward by
hand is watched through autograd hooks: which gradients each backward pass computes, in
which order, and whether the forward ran again.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)
from pipeline_lib.schedules import (BUILDERS, Schedule, ScheduleError, build,
                                    execution_order, one_f_one_b, validate, zb_h1)
from pipeline_lib.timeline import _simulate, rank_facts, simulate

# what computes ZB-H1 for the learner
SCHEDULE_FUNCTIONS = (*BUILDERS.values(), build, "pipeline_lib.course.pytorch_schedules")
# what times it: the simulator, its private engine and the order that engine times
SIMULATOR = (simulate, _simulate, execution_order, rank_facts)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


# (F, I, W) per stage. The published idle time (p-1)(F+I-W) holds exactly while
# W <= min(F, I): the papers' W <= I <= F, then I longer than F with W the shortest (still
# inside); outside it, W longer than I, W longer than F, and W the longest of the three (a
# W that waits sets no pace: max(..., W) is wrong)
BUBBLE_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.5, 1.0), (1.0, 0.5, 1.0),
                (2.0, 1.0, 1.5), (0.5, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 3.0)]


def _costs(rng: Any) -> tuple[int, float, float, float]:
    """Ranks and (F, I, W) for a drawn case: halves from 0.5 to 3, in any order."""
    return (rng.randint(2, 6), *(rng.randint(1, 6) / 2 for _ in range(3)))


@ignores_namespace(1)
def check_zb_h1_bubble(zb_h1_bubble: Callable) -> None:
    """Exercise 2b.1: ZB-H1's idle time per rank against the simulator's, at p = 2, 3, 4,
    for costs inside and outside the published formula's W ≤ min(F, I), and at ranks and costs
    drawn for this run, each with m = 3p micro-batches (the formula holds from m = p on).
    A message names the learner's value, never the simulator's."""
    shown = [(p, *costs) for p in (2, 3, 4) for costs in BUBBLE_COSTS]
    for p, f, i, w in shown + hidden_cases(_costs, 8, shown=shown):
        schedule = zb_h1(p, 3 * p)
        timeline = simulate(schedule, forward=f, backward=i + w, weight=w)
        simulated = max(r.bubble for r in rank_facts(schedule, timeline))
        with withheld(*SIMULATOR, *SCHEDULE_FUNCTIONS):
            yours = zb_h1_bubble(p, f, i, w)
        _require(isinstance(yours, numbers.Real) and not isinstance(yours, bool),
                 f"zb_h1_bubble must return a number, got {yours!r}")
        published = (p - 1) * (f + i - w)
        _require(abs(yours - simulated) < 1e-9,
                 f"at p={p}, F={f:g}, I={i:g}, W={w:g} your formula gives {float(yours):g}, "
                 f"{'more' if yours > simulated else 'less'} than the simulated ZB-H1 idles "
                 f"per rank"
                 + (" (that is 1F1B's bubble: which part of the drain do the deferred "
                    "Ws fill?)" if abs(yours - (p - 1) * (f + i + w)) < 1e-9 else "")
                 + (" (your value equals the published formula's here, which holds only "
                    "while W <= min(F, I): what else can a rank wait for?)"
                    if abs(yours - published) < 1e-9 else ""))


ZB_SIZES = [(2, 4), (4, 8), (4, 5), (3, 2)]


@ignores_namespace(1)
def check_my_zb_h1(my_zb_h1: Callable) -> None:
    """Exercise 2b.2: a valid schedule with every backward split, no rank above 1F1B's
    peak, and ZB-H1's step time, at the notebook's sizes and at sizes drawn for this run;
    the builders are withheld (``BUILDERS["zb_h1"]`` too)."""
    costs = dict(forward=1, backward=2, weight=1)
    drawn = hidden_cases(lambda rng: (rng.randint(2, 6), rng.randint(1, 12)), 3, shown=ZB_SIZES)
    for p, m in ZB_SIZES + drawn:
        with withheld(*SCHEDULE_FUNCTIONS):
            mine = my_zb_h1(p, m)
        _require(isinstance(mine, Schedule), f"return a Schedule, got {type(mine).__name__}")
        _require((mine.ranks, mine.microbatches) == (p, m),
                 f"my_zb_h1({p}, {m}) is for ranks={mine.ranks}, "
                 f"microbatches={mine.microbatches}")
        try:
            validate(mine)
        except ScheduleError as error:     # names the rank, step and micro-batch at fault
            raise ExerciseFailed(f"p={p}, m={m}: the schedule is not valid: {error}") from None
        kinds = {a.kind for program in mine.actions for a in program}
        _require(kinds == {"F", "I", "W"}, f"p={p}, m={m}: split every backward into I and W "
                                           f"(weight_lag=...); your schedule has kinds "
                                           f"{sorted(kinds)}")
        t, base = simulate(mine, **costs), simulate(one_f_one_b(p, m), **costs)
        _require(max(t.peak_in_flight()) <= max(base.peak_in_flight()),
                 f"p={p}, m={m}: a rank holds {max(t.peak_in_flight())} micro-batches, 1F1B "
                 f"at most {max(base.peak_in_flight())}: too many forwards ahead, or Ws that "
                 f"wait too long")
        target = simulate(zb_h1(p, m), **costs).makespan
        _require(abs(t.makespan - target) < 1e-9,
                 f"p={p}, m={m}: your step takes {t.makespan:g} cost units, "
                 f"{'longer' if t.makespan > target else 'shorter'} than ZB-H1's: check the "
                 f"weight lag of each stage")


class _Watch:
    """What the learner's function does with one stage: its forwards, and for each backward
    pass through the stage's output (``torch.autograd.grad`` or ``.backward()``, whatever
    it starts from: ``y`` with a gradient, ``(y * g).sum()``...) which gradients it
    computed, the stage input's and the parameters'. Seen through autograd hooks, not
    through names, so every way of calling autograd is seen alike."""

    def __init__(self, stage: nn.Module):
        self.params = list(stage.parameters())
        self.forwards, self.inputs, self.passes = 0, [], []
        self.handles = [stage.register_forward_pre_hook(self._pre),
                        stage.register_forward_hook(self._post)]
        self.handles += [p.register_hook(self._seen(("weight", k)))
                         for k, p in enumerate(self.params)]

    def _seen(self, what: Any) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self.passes:
                self.passes[-1].add(what)
        return hook

    def _pre(self, module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            self.inputs.append(x)
            self.handles.append(x.register_hook(self._seen("input")))

    def _post(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.forwards += 1
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.handles.append(out.register_hook(lambda grad: self.passes.append(set())))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


#: The notebook's two stages: (rows of a micro-batch, widths), a GELU between two Linears,
#: then a bias-free Linear, Tanh, Linear, ReLU, Linear.
SHOWN_STAGES = [(5, (6, 8, 4)), (5, (4, 4, 3, 3))]


def _stage(widths: tuple[int, ...]) -> nn.Module:
    if len(widths) == 3:
        a, b, c = widths
        return nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c))
    a, b, c, d = widths
    return nn.Sequential(nn.Linear(a, b, bias=False), nn.Tanh(), nn.Linear(b, c),
                         nn.ReLU(), nn.Linear(c, d))


def _stage_case(rng: Any) -> tuple[int, tuple[int, ...]]:
    """Rows and widths of a stage drawn for this run, of either shape."""
    return rng.randint(2, 9), tuple(rng.randint(2, 9) for _ in range(rng.choice([3, 4])))


def _stages() -> Iterator[tuple[nn.Module, int]]:
    """The notebook's two stages, then two of sizes drawn for this run: each with the rows
    of its micro-batch."""
    torch.manual_seed(0)
    for rows, widths in SHOWN_STAGES + hidden_cases(_stage_case, 2, shown=SHOWN_STAGES):
        yield _stage(widths), rows


def _answer_problem(answer: Any, x: torch.Tensor, params: list[nn.Parameter]) -> str:
    """What makes ``answer`` no (input gradient, weight gradients) pair; "" if it is one."""
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        return (f"return a pair (input gradient, list of weight gradients), got "
                f"{type(answer).__name__}")
    grad_x, grad_w = answer
    if not (isinstance(grad_x, torch.Tensor) and grad_x.shape == x.shape):
        return (f"the input gradient must be a tensor of the input's shape {list(x.shape)}, "
                f"got {grad_x!r}"[:300])
    if not (isinstance(grad_w, (tuple, list)) and len(grad_w) == len(params) and all(
            isinstance(g, torch.Tensor) and g.shape == p.shape for g, p in zip(grad_w, params))):
        return (f"the weight gradients must be a list of {len(params)} tensors, one per "
                f"stage.parameters() in that order, each of its parameter's shape")
    return ""


@ignores_namespace(1)
def check_input_then_weight(input_then_weight: Callable) -> None:
    """Exercise 2b.3: I then W by hand: a first backward pass that computes the input's
    gradient and no weight's, then passes from the same graph (no second forward) that
    compute every weight's gradient and not the input's again, nothing left in ``.grad``,
    and both results equal to autograd's full backward. How the passes are started is
    free (``torch.autograd.grad(y, ..., g)``, ``(y * g).sum()``...): autograd hooks see
    what each pass computes. On the notebook's two stages and on two of sizes drawn for
    this run."""
    for stage, rows in _stages():
        reference = copy.deepcopy(stage)
        x = torch.randn(rows, stage[0].in_features)
        g = torch.randn(rows, stage[-1].out_features)
        xr = x.clone().requires_grad_()
        expected = torch.autograd.grad(reference(xr), [xr, *reference.parameters()], g)
        params = list(stage.parameters())
        watch = _Watch(stage)
        try:
            with withheld("pipeline_lib.split_backward"):
                answer = input_then_weight(stage, x, g)
        finally:
            watch.remove()
        _require(all(p.grad is None for p in params) and x.grad is None
                 and all(t.grad is None for t in watch.inputs),
                 "after your function some `.grad` is filled: compute the gradients with "
                 "torch.autograd.grad, which returns them, not with .backward()")
        _require(watch.forwards == 1, f"your function ran the stage's forward "
                                      f"{watch.forwards} times; run it once and compute I "
                                      f"and W from that graph")
        _require(len(watch.passes) >= 2,
                 f"your function ran {len(watch.passes)} backward pass(es) through the "
                 f"stage's output: I is one (the input's gradient only), W a later one (the "
                 f"weights')")
        first, later = watch.passes[0], set().union(*watch.passes[1:])
        _require(not any(what != "input" for what in first),
                 "your first backward pass computes weight gradients: I asks for the "
                 "input's gradient only, so that it can be sent on at once")
        _require("input" in first, "your first backward pass does not compute the input's "
                                   "gradient: I comes first")
        _require("input" not in later,
                 "a later backward pass computes the input's gradient again: W asks for the "
                 "weights' gradients only (I already has the input's)")
        _require(later == {("weight", k) for k in range(len(params))},
                 "after I, the passes must compute every weight's gradient (all of "
                 "stage.parameters())")
        problem = _answer_problem(answer, x, params)
        _require(not problem, problem)
        grad_x, grad_w = answer
        _require(torch.allclose(grad_x, expected[0], atol=1e-6),
                 "the input gradient differs from autograd's full backward")
        _require(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grad_w, expected[1:])),
                 "the weight gradients differ from autograd's full backward (one per "
                 "stage.parameters(), in that order)")
