"""Checks of notebook 02b's exercises (the split backward and zero-bubble schedules).

Each ``check_*`` runs the learner's function where the library functions that *are* the
answer are withheld. ZB-H1's bubble is checked at costs beyond the papers' W ≤ I ≤ F,
where the published formula, printed in notebooks 02 and 02b, no longer holds; the split
backward by hand is watched: which gradients each ``torch.autograd.grad`` call asks for,
in which order, and whether the forward ran again.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipeline_lib.course.exercises import ExerciseFailed, withheld
from pipeline_lib.schedules import (BUILDERS, Schedule, ScheduleError, build,
                                    one_f_one_b, validate, zb_h1)
from pipeline_lib.timeline import rank_facts, simulate

Namespace = dict[str, Any] | None

# what computes ZB-H1 or its timeline for the learner
SCHEDULE_FUNCTIONS = (*BUILDERS.values(), build, "pipeline_lib.course.pytorch_schedules")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


# (F, I, W) per stage: the papers' W <= I <= F, then W longer than I, I longer than F, and
# W the longest of the three (a W that waits sets no pace: max(..., W) is wrong)
BUBBLE_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.5, 1.0), (1.0, 0.5, 1.0),
                (2.0, 1.0, 1.5), (0.5, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 3.0)]


def check_zb_h1_bubble(zb_h1_bubble: Callable, namespace: Namespace = None) -> None:
    """Exercise 2b.1: ZB-H1's idle time per rank against the simulator's, at p = 2, 3, 4,
    for costs inside and outside the published formula's W ≤ I ≤ F."""
    for p in (2, 3, 4):
        for f, i, w in BUBBLE_COSTS:
            schedule = zb_h1(p, 3 * p)
            timeline = simulate(schedule, forward=f, backward=i + w, weight=w)
            simulated = max(r.bubble for r in rank_facts(schedule, timeline))
            with withheld(simulate, rank_facts, *SCHEDULE_FUNCTIONS):
                yours = zb_h1_bubble(p, f, i, w)
            _require(isinstance(yours, (int, float)),
                     f"zb_h1_bubble must return a number, got {yours!r}")
            published = (p - 1) * (f + i - w)
            _require(abs(yours - simulated) < 1e-9,
                     f"at p={p}, F={f:g}, I={i:g}, W={w:g} the simulated ZB-H1 idles "
                     f"{simulated:g} per rank, your formula gives {yours:g}"
                     + (" (that is 1F1B's bubble: which part of the drain do the deferred "
                        "Ws fill?)" if abs(yours - (p - 1) * (f + i + w)) < 1e-9 else "")
                     + (" (that is the published formula, which assumes W <= I <= F: what "
                        "else can a rank wait for?)"
                        if abs(yours - published) < 1e-9 and not w <= i <= f else ""))


ZB_SIZES = [(2, 4), (4, 8), (4, 5), (3, 2)]


def check_my_zb_h1(my_zb_h1: Callable, namespace: Namespace = None) -> None:
    """Exercise 2b.2: a valid schedule with every backward split, no rank above 1F1B's
    peak, and ZB-H1's step time; the builders are withheld."""
    costs = dict(forward=1, backward=2, weight=1)
    for p, m in ZB_SIZES:
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
                 f"p={p}, m={m}: your step takes {t.makespan:g} cost units, ZB-H1's "
                 f"{target:g}: check the weight lag of each stage")


@contextmanager
def _watched_grad(namespace: Namespace) -> Iterator[list[tuple[tuple, tuple]]]:
    """While the block runs, every ``torch.autograd.grad`` call (by that name, or by a
    name the notebook bound to it) is written down: its outputs and its inputs."""
    original, calls = torch.autograd.grad, []

    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        as_tuple = (lambda t: tuple(t) if isinstance(t, (list, tuple)) else (t,))
        calls.append((as_tuple(outputs), as_tuple(inputs)))
        return original(outputs, inputs, *args, **kwargs)

    names = [k for k, v in (namespace or {}).items() if v is original]
    torch.autograd.grad = grad
    for k in names:
        namespace[k] = grad
    try:
        yield calls
    finally:
        torch.autograd.grad = original
        for k in names:
            namespace[k] = original


def _stages() -> Iterator[nn.Module]:
    torch.manual_seed(0)
    yield nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 4))
    yield nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 3),
                        nn.ReLU(), nn.Linear(3, 3))


def check_input_then_weight(input_then_weight: Callable, namespace: Namespace = None
                            ) -> None:
    """Exercise 2b.3: I then W by hand: the input gradient first (no weight in that call),
    then the weight gradients from the same graph (no second forward), nothing left in
    ``.grad``, and both equal to autograd's full backward."""
    for stage in _stages():
        reference = copy.deepcopy(stage)
        x = torch.randn(5, stage[0].in_features)
        g = torch.randn(5, stage[-1].out_features)
        xr = x.clone().requires_grad_()
        expected = torch.autograd.grad(reference(xr), [xr, *reference.parameters()], g)
        params = list(stage.parameters())
        forwards = []
        hook = stage.register_forward_hook(lambda module, args, out: forwards.append(out))
        try:
            with _watched_grad(namespace) as calls, \
                    withheld("pipeline_lib.split_backward"):
                answer = input_then_weight(stage, x, g)
        finally:
            hook.remove()
        _require(all(p.grad is None for p in params) and x.grad is None,
                 "after your function some `.grad` is filled: compute the gradients with "
                 "torch.autograd.grad, which returns them, not with .backward()")
        _require(len(forwards) == 1, f"your function ran the stage's forward {len(forwards)} "
                                     f"times; run it once and compute I and W from that graph")
        is_param = [[any(t is p for p in params) for t in inputs] for _, inputs in calls]
        _require(len(calls) >= 2,
                 f"your function called torch.autograd.grad {len(calls)} time(s): I is one "
                 f"call (the input's gradient only), W a later one (the weights')")
        _require(not any(is_param[0]),
                 "your first torch.autograd.grad call asks for weight gradients: I asks for "
                 "the input's gradient only, so that it can be sent on at once")
        later = [t for flags, (_, inputs) in zip(is_param[1:], calls[1:]) for t, f in
                 zip(inputs, flags) if f]
        _require(all(all(flags) for flags in is_param[1:]) and
                 {id(p) for p in later} == {id(p) for p in params},
                 "after I, torch.autograd.grad must be asked for the weights' gradients, all "
                 "of them and nothing else")
        _require(all(any(o is forwards[0] for o in outputs) for outputs, _ in calls),
                 "every torch.autograd.grad call must start from the stage's output of its "
                 "one forward (keep that graph for W: retain_graph=True in I)")
        grad_x, grad_w = answer
        _require(isinstance(grad_x, torch.Tensor) and grad_x.shape == x.shape
                 and torch.allclose(grad_x, expected[0], atol=1e-6),
                 "the input gradient differs from autograd's full backward")
        grad_w = list(grad_w)
        _require(len(grad_w) == len(params) and all(
            torch.allclose(a, b, atol=1e-6) for a, b in zip(grad_w, expected[1:])),
            "the weight gradients differ from autograd's full backward (one per "
            "stage.parameters(), in that order)")
