"""Checks of notebook 03's exercises (a Transformer LM through a pipeline).

Each check computes the expected answer first, with the library, and only then calls the
learner's function inside `withheld`, so that calling the library function that *is* the
answer fails instead of passing. The inputs are chosen so that the plausible wrong answers
differ from the right one: cost vectors where "the last layer alone, the rest even", a
greedy "close a stage when it reaches its share" and the "most even" balance (smallest
variance of the stage costs) all lose, costs in seconds where a search written for whole
numbers fails, and evaluation data whose last batch is shorter than the others, so that a
mean of batch means is not the token mean.

Every check raises `ExerciseFailed` with what to change; the notebook's check cell runs it
inside ``exercise("Exercise 3.N (...)")``, which prefixes the exercise's name.
"""
from __future__ import annotations

import math
import numbers
import signal
import statistics
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)
from pipeline_lib.lm.data import get_batch
from pipeline_lib.lm.loops import evaluate, lm_loss
from pipeline_lib.partition import (balance_by_memory, balance_by_params, balance_by_time,
                                    optimal_split, stage_costs)

__all__ = ["UNEVEN_COSTS", "LONG_COSTS", "check_fastest_balance", "check_token_weighted_loss",
           "check_partitioner"]

#: Layer costs (3 stages) on which a balance with the last layer alone and the rest even,
#: an even layer count, and both greedy rules ("close a stage once it reaches its share of
#: the total", "close it before the layer that would take it past its share") all leave a
#: slowest stage at least 25% above the best one; on the third, so do the "most even"
#: balances (the smallest variance of the stage costs, or the smallest gap between the
#: slowest and the fastest stage), which the first two cannot tell from the best.
#: Whole numbers, so that sums are exact.
UNEVEN_COSTS: tuple[tuple[float, ...], ...] = (
    (1.0, 9.0, 3.0, 1.0, 1.0, 9.0, 1.0),
    (8.0, 4.0, 8.0, 8.0, 2.0, 2.0, 9.0),
    (3.0, 1.0, 2.0, 2.0, 8.0, 1.0, 1.0),
)

#: 50 layer costs for 8 stages, on which the same four rules lose by 9% or more. The third
#: is in seconds, as `layer_times` measures (tenths of a millisecond): a search that
#: assumes whole-number costs (bisecting with ``//``, stepping by 1) fails on it, and the
#: balance with the smallest variance of the stage costs loses on it by 6%.
LONG_COSTS: tuple[tuple[float, ...], ...] = (
    (2, 5, 9, 4, 8, 9, 4, 6, 7, 5, 7, 7, 5, 1, 7, 9, 8, 8, 6, 9, 3, 5, 4, 4, 3,
     2, 8, 8, 2, 2, 1, 1, 4, 2, 3, 3, 8, 8, 6, 3, 6, 2, 8, 7, 3, 1, 8, 4, 1, 1),
    (6, 6, 3, 5, 5, 6, 9, 3, 3, 4, 1, 4, 3, 9, 6, 6, 1, 6, 3, 9, 9, 1, 5, 3, 2,
     5, 8, 6, 7, 3, 8, 4, 3, 8, 2, 8, 2, 5, 7, 3, 4, 5, 6, 2, 2, 3, 9, 6, 5, 3),
    tuple(tenths / 10_000 for tenths in (
        70, 87, 22, 79, 45, 80, 74, 25, 89, 35, 21, 26, 14, 38, 72, 34, 55, 86, 14, 19, 36,
        88, 43, 29, 35, 56, 35, 64, 64, 88, 74, 57, 53, 71, 54, 50, 51, 49, 54, 53, 61, 89,
        12, 80, 54, 40, 88, 24, 62, 25)),
)

_ANSWERS = (optimal_split, balance_by_params, balance_by_time, balance_by_memory)


def _checked_balance(balance: Any, costs: Sequence[float], stages: int, case: str) -> list[int]:
    """The learner's balance as a list of ints: any sequence of whole numbers counts (a
    list, a tuple, a numpy array of ints, a tensor of ints), one per stage, each at least
    1, covering every layer once. The messages name what is wrong with it, not a library
    function that would compute one (those are withheld here)."""
    if isinstance(balance, torch.Tensor):
        balance = balance.tolist()
    not_counts = (str, bytes, Mapping, set, frozenset)   # text, or no order
    if isinstance(balance, not_counts) or not hasattr(balance, "__iter__"):
        raise ExerciseFailed(f"{case}: return a balance, one layer count per stage (a list "
                             f"such as [3, 2, 2]), got {type(balance).__name__}")
    counts = list(balance)
    wrong = [c for c in counts if isinstance(c, bool) or not isinstance(c, numbers.Integral)]
    if wrong:
        raise ExerciseFailed(f"{case}: your balance holds {wrong[0]!r} "
                             f"({type(wrong[0]).__name__}): a stage's layer count is a whole "
                             f"number")
    counts = [int(c) for c in counts]
    if len(counts) != stages:
        raise ExerciseFailed(f"{case}: your balance {counts} has {len(counts)} stages; "
                             f"return one layer count per stage, {stages} in all (every "
                             f"stage at least one layer)")
    if min(counts) < 1:
        raise ExerciseFailed(f"{case}: your balance {counts} gives a stage {min(counts)} "
                             f"layers: every stage needs at least one")
    if sum(counts) != len(costs):
        raise ExerciseFailed(f"{case}: your balance {counts} covers {sum(counts)} layers, "
                             f"but there are {len(costs)}: each layer goes to exactly one "
                             f"stage")
    return counts


def _compare(balance: list[int], costs: Sequence[float], best: list[int], case: str,
             rel: float, unit: str) -> None:
    slowest, fastest = max(stage_costs(costs, balance)), max(stage_costs(costs, best))
    if slowest > fastest * (1 + rel):
        raise ExerciseFailed(
            f"{case}: the slowest stage of your balance {balance} costs {slowest:g}{unit}, "
            f"{slowest / fastest - 1:.0%} more than the best balance's {fastest:g}{unit}. "
            f"Cost every stage as the sum of its layers' costs and compare balances by their "
            f"slowest stage: a rule that fills stages one after another, or gives the last "
            f"layer a stage of its own, can miss the best cut")


def _costs(layers: int, most: int) -> Callable[[Any], tuple[tuple[float, ...], int]]:
    """Draws (whole-number layer costs, stages) for a hidden case of ``layers`` layers."""
    return lambda rng: (tuple(float(rng.randint(1, 9)) for _ in range(layers)),
                        rng.randint(2, most))


@ignores_namespace(3)
def check_fastest_balance(fastest_balance: Callable[[list[float], int], Any],
                          measured: Mapping[str, Sequence[float]], stages: int) -> None:
    """Exercise 3.1: ``fastest_balance(costs, stages)`` minimises the slowest stage.

    ``measured`` maps a description to the notebook's measured layer times (seconds); they
    are checked for ``stages`` and 3 stages, within 5% (the learner may sum in another
    order; timings differ in their second digit anyway). `UNEVEN_COSTS` are checked for 3
    stages exactly, and defeat the rules that pass on a decoder-dominated model; and so
    are cost vectors drawn for this run (7 to 9 layers over 2 to 4 stages).
    """
    cases = [(f"{k} stages, times {which}", list(costs), k, 0.05, " s")
             for which, costs in measured.items() for k in sorted({stages, 3})]
    cases += [(f"3 stages, costs {list(costs)}", list(costs), 3, 1e-9, "")
              for costs in UNEVEN_COSTS]
    cases += [(f"{k} stages, costs {list(costs)}", list(costs), k, 1e-9, "")
              for layers in (7, 8, 9) for costs, k in hidden_cases(_costs(layers, 4), 1)]
    expected = [optimal_split(costs, k) for _, costs, k, _, _ in cases]   # before withheld
    for (case, costs, k, rel, unit), best in zip(cases, expected):
        with withheld(*_ANSWERS):
            answer = fastest_balance(list(costs), k)
        _compare(_checked_balance(answer, costs, k, case), costs, best, case, rel, unit)


@ignores_namespace(4)
def check_token_weighted_loss(token_weighted_loss: Callable[[Any, torch.Tensor, int], Any],
                              model: torch.nn.Module, source: torch.Tensor, bptt: int) -> None:
    """Exercise 3.3: the mean loss per target token, on batches of uneven length.

    Takes the first ``2 * bptt + 6`` columns of ``source`` (batches of ``bptt``, ``bptt``
    and 5 positions), so that the mean of the batch means, the classic tutorial's formula
    and a loop that drops the short batch all give other numbers; then a window of columns
    drawn for this run (another start, a short last batch of another length). ``model``
    runs in evaluation mode (no dropout) and is left in the mode it came in.
    """
    if source.size(1) < 4 * bptt + 2:
        raise ValueError(f"source has {source.size(1)} columns; the check needs at least "
                         f"4 * bptt + 2 = {4 * bptt + 2}")
    (start, length), = hidden_cases(
        lambda rng: (rng.randint(1, source.size(1) - 3 * bptt - 1),
                     2 * bptt + rng.randint(2, bptt - 1)), 1, shown=[(0, 2 * bptt + 6)])
    for first, columns in [(0, 2 * bptt + 6), (start, length)]:
        _check_token_weighted(token_weighted_loss, model,
                              source[:, first:first + columns], bptt)


def _check_token_weighted(token_weighted_loss: Callable[[Any, torch.Tensor, int], Any],
                          model: torch.nn.Module, short: torch.Tensor, bptt: int) -> None:
    was_training = model.training
    model.eval()
    try:
        expected, _ = evaluate(model, short, bptt)
        with torch.no_grad():
            batches = [get_batch(short, i, bptt) for i in range(0, short.size(1) - 1, bptt)]
            batch_means = [lm_loss(model(x), y).item() for x, y in batches]
        with withheld(evaluate):
            mine = token_weighted_loss(model, short, bptt)
    finally:
        model.train(was_training)
    tokens = sum(y.numel() for _, y in batches)
    sizes = [y.size(1) for _, y in batches]
    if isinstance(mine, torch.Tensor) or not isinstance(mine, float):
        raise ExerciseFailed(f"return the mean loss as a Python float, got "
                             f"{type(mine).__name__} (a tensor's .item() gives one)")
    if math.isclose(mine, expected, rel_tol=1e-5):
        return
    if math.isclose(mine, statistics.mean(batch_means), rel_tol=1e-5):
        raise ExerciseFailed(
            f"you returned {mine:.5f}, the mean of the {len(batches)} batch means, but the "
            f"batches hold {sizes} positions: dividing by the number of batches weighs the "
            f"{sizes[-1]} positions of the last batch like a full batch's {bptt}. That is the "
            f"classic tutorial's bug 1 (it weighted batches, not tokens). Weigh each batch by "
            f"how many target tokens it has")
    if math.isclose(mine, short.size(0) * sum(batch_means) / (short.size(1) - 1), rel_tol=1e-5):
        raise ExerciseFailed(
            f"you returned {mine:.5f}, the classic tutorial's formula (bug 1): batch losses "
            f"times len(data), which is the number of rows here, divided by the length of the "
            f"split. Weigh each batch by how many target tokens it has")
    raise ExerciseFailed(
        f"you returned {mine:.5f}, {'more' if mine > expected else 'less'} than the mean over "
        f"the {tokens} target tokens of {short.size(1)} columns, in batches of {sizes} "
        f"positions. Every batch counts (i up to source.size(1) - 1: the last column has no "
        f"next word), each as much as its tokens")


@contextmanager
def _time_limit(seconds: float, message: str) -> Iterator[None]:
    """Raise `ExerciseFailed` if the block runs longer than ``seconds`` (main thread on a
    POSIX system only, where ``SIGALRM`` exists; elsewhere the block runs unlimited)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise ExerciseFailed(message)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@ignores_namespace(1)
def check_partitioner(partition: Callable[[list[float], int], Any],
                      seconds: float = 10.0) -> None:
    """Exercise 3.2: ``partition(costs, stages)`` is optimal on 50 layers over 8 stages.

    The reference is `optimal_split` (a dynamic program), computed before the learner's
    call; trying every balance would take C(49, 7) = 86 million of them, so the learner's
    function gets ``seconds`` per cost vector. Checked: `LONG_COSTS` over 8 stages (where
    greedy and "most even" rules lose, and the costs of the third are not whole numbers),
    then the same costs over 2 and 49 stages (the edge cases of a search), then two vectors
    of 50 whole-number costs drawn for this run, over 3 to 12 stages.
    """
    cases = [(list(costs), k) for costs in LONG_COSTS for k in (8, 2, 49)]
    cases += [(list(costs), k) for costs, k in hidden_cases(_costs(50, 12), 2)]
    expected = [optimal_split(costs, k) for costs, k in cases]            # before withheld
    for (costs, k), best in zip(cases, expected):
        case = f"{len(costs)} layers over {k} stages, costs {costs}"
        slow = (f"{case}: your function ran longer than {seconds:g} s. Trying every balance "
                f"means {math.comb(len(costs) - 1, k - 1):,} of them; find the smallest "
                f"achievable slowest stage without listing them")
        with withheld(*_ANSWERS), _time_limit(seconds, slow):
            answer = partition(list(costs), k)
        _compare(_checked_balance(answer, costs, k, case), costs, best, case, 1e-9, "")
