"""Notebook 03's exercise checks, in-process: the solution passes, and plausible wrong
answers and the library shortcut each fail with the exercise's own message."""
from __future__ import annotations

import functools
import itertools
import math
import statistics

import pytest
import torch

from pipeline_lib.course.checks import nb03
from pipeline_lib.course.exercises import exercise
from pipeline_lib.lm.data import get_batch
from pipeline_lib.lm.loops import evaluate, lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.partition import optimal_split, stage_costs
from conftest import fails
from copies import copied

EX31 = "Exercise 3.1 (the balance that minimises the step)"
EX32 = "Exercise 3.2 (an optimal partitioner for 50 layers)"
EX33 = "Exercise 3.3 (a token-weighted evaluation)"

#: Per-layer times shaped like the notebook's CPU model: a cheap embedding, four blocks, a
#: decoder with the loss that costs most (these are what the decoder-dominated check used).
MEASURED = {"with the loss": [0.7e-3, 5.8e-3, 4.1e-3, 5.6e-3, 5.6e-3, 30.8e-3],
            "without the loss": [0.7e-3, 5.8e-3, 4.1e-3, 5.6e-3, 5.6e-3, 27.1e-3]}



def passes(name: str, run, capsys) -> None:
    with exercise(name):
        run()
    assert f"{name}: passed" in capsys.readouterr().out


# --------------------------------------------------------------------- 3.1 and 3.2: balances


def brute_force(costs, stages):
    """The notebook's solution of 3.1: try every placement of the cuts."""
    best, best_slowest = None, math.inf
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        slowest = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        if slowest < best_slowest:
            best, best_slowest = bounds, slowest
    return [b - a for a, b in zip(best, best[1:])]


def bottleneck_search(costs, stages):
    """The notebook's solution of 3.2: binary search on the slowest stage's cost, each
    candidate tested by packing layers greedily; then the fewest-layers-first balance."""
    def stages_needed(limit):
        count, load = 1, 0.0
        for c in costs:
            if load + c > limit:
                count, load = count + 1, 0.0
            load += c
        return count

    low, high = max(costs), sum(costs)
    candidates = sorted({sum(costs[a:b]) for a in range(len(costs))
                         for b in range(a + 1, len(costs) + 1)})
    candidates = [c for c in candidates if low <= c <= high]
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if stages_needed(candidates[mid]) <= stages:
            hi = mid
        else:
            lo = mid + 1
    limit = candidates[lo]
    balance, load, count = [], 0.0, 0
    for i, c in enumerate(costs):
        left, open_stages = len(costs) - i, stages - len(balance)
        if count and (load + c > limit or left < open_stages):
            balance.append(count)
            load, count = 0.0, 0
        load += c
        count += 1
    balance.append(count)
    return balance


def last_alone(costs, stages):
    """The last layer (the decoder, with the loss) alone, the other layers spread evenly."""
    q, r = divmod(len(costs) - 1, stages - 1)
    return [q + (i < r) for i in range(stages - 1)] + [1]


def even_counts(costs, stages):
    q, r = divmod(len(costs), stages)
    return [q + (i < r) for i in range(stages)]


def greedy_at_share(costs, stages):
    """Close a stage as soon as it reaches its share of the total."""
    share, balance, load, count = sum(costs) / stages, [], 0.0, 0
    for i, c in enumerate(costs):
        load, count = load + c, count + 1
        must = len(costs) - i - 1 == stages - len(balance) - 1
        if len(balance) < stages - 1 and (load >= share or must):
            balance.append(count)
            load, count = 0.0, 0
    return balance + [count] if count else balance


def greedy_below_share(costs, stages):
    """Close a stage before the layer that would take it past its share."""
    share, balance, load, count = sum(costs) / stages, [], 0.0, 0
    for c in costs:
        if count and load + c > share and len(balance) < stages - 1:
            balance.append(count)
            load, count = 0.0, 0
        load, count = load + c, count + 1
    return balance + [count]


def every_balance(layers, stages):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def smallest_spread(costs, stages):
    """The "most even" stages: the smallest gap between the slowest and the fastest."""
    return min(every_balance(len(costs), stages),
               key=lambda b: max(stage_costs(costs, b)) - min(stage_costs(costs, b)))


def smallest_variance(costs, stages):
    """The "most even" stages: the smallest sum of squared stage costs (their sum is
    fixed, so the smallest variance), by dynamic programming: fast enough for 3.2."""
    n, prefix = len(costs), list(itertools.accumulate(costs, initial=0))

    @functools.lru_cache(maxsize=None)
    def best(start, left):
        if left == 1:
            return (prefix[n] - prefix[start]) ** 2, (n - start,)
        return min(((prefix[end] - prefix[start]) ** 2 + best(end, left - 1)[0],
                    (end - start, *best(end, left - 1)[1]))
                   for end in range(start + 1, n - left + 2))
    return list(best(0, stages)[1])


def whole_number_search(costs, stages):
    """Binary search on the slowest stage stepping by whole numbers, as for integer costs:
    right on LONG_COSTS's first two, wrong for times in seconds."""
    def stages_needed(limit):
        count, load = 1, 0
        for c in costs:
            if load + c > limit:
                count, load = count + 1, 0
            load += c
        return count

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if stages_needed(mid) <= stages:
            hi = mid
        else:
            lo = mid + 1
    balance, load = [], 0
    for i, c in enumerate(costs):
        must_close = len(costs) - i <= stages - len(balance)
        if balance and balance[-1] and (load + c > lo or must_close):
            balance.append(0)
            load = 0
        if not balance:
            balance.append(0)
        load += c
        balance[-1] += 1
    return balance


def shortcut(costs, stages):
    return optimal_split(costs, stages)


def test_the_designed_costs_defeat_every_rule_by_a_margin():
    for costs, stages in [*((c, 3) for c in nb03.UNEVEN_COSTS),
                          *((c, 8) for c in nb03.LONG_COSTS)]:
        best = max(stage_costs(costs, optimal_split(costs, stages)))
        for rule in (last_alone, even_counts, greedy_at_share, greedy_below_share):
            assert max(stage_costs(costs, rule(list(costs), stages))) >= 1.09 * best, rule


def test_the_designed_costs_defeat_the_most_even_balances():
    """The first cost vectors cannot tell "most even" from "slowest stage smallest"."""
    for costs, stages, rules, margin in [(nb03.UNEVEN_COSTS[-1], 3,
                                          (smallest_spread, smallest_variance), 1.25),
                                         (nb03.LONG_COSTS[-1], 8, (smallest_variance,), 1.05)]:
        best = max(stage_costs(costs, optimal_split(costs, stages)))
        for rule in rules:
            assert max(stage_costs(costs, rule(list(costs), stages))) >= margin * best, rule


def test_3_1_solution_passes(capsys):
    passes(EX31, lambda: nb03.check_fastest_balance(brute_force, MEASURED, 2), capsys)


@pytest.mark.parametrize("wrong", [last_alone, even_counts, greedy_at_share,
                                   greedy_below_share, smallest_spread, smallest_variance])
def test_3_1_wrong_answers_fail(wrong):
    message = fails(EX31, lambda: nb03.check_fastest_balance(wrong, MEASURED, 2))
    assert "slowest stage" in message


def test_3_1_the_wrong_rules_pass_on_the_decoder_dominated_times_alone():
    """Why the check needs UNEVEN_COSTS: on the measured times "last alone" is optimal."""
    for costs in MEASURED.values():
        assert last_alone(costs, 2) == optimal_split(costs, 2)


def test_3_1_shortcut_fails():
    message = fails(EX31, lambda: nb03.check_fastest_balance(shortcut, MEASURED, 2))
    assert "optimal_split" in message
    for captured in (lambda costs, stages, _split=optimal_split: _split(costs, stages),
                     lambda costs, stages: __import__("pipeline_lib").partition.optimal_split(
                         costs, stages)):
        assert "optimal_split" in fails(EX31, lambda: nb03.check_fastest_balance(
            captured, MEASURED, 2))
    assert optimal_split([1.0, 2.0], 2) == [1, 1]       # restored afterwards


SHOWN = {(tuple(c), 3): optimal_split(list(c), 3) for c in nb03.UNEVEN_COSTS}
SHOWN.update({(tuple(c), k): optimal_split(list(c), k) for c in MEASURED.values()
              for k in (2, 3)})


def shown_table(costs, stages):          # the best balances of the shown cost vectors
    return SHOWN[tuple(costs), stages]


def rest_on_the_last(costs, stages):     # one layer each, the rest on the last stage
    return [1] * (stages - 1) + [len(costs) - stages + 1]


def first_best_by_sum_of_squares(costs, stages):   # "most even" by another measure
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = sum(x * x for x in loads)
        if best is None or key < best[0]:
            best = (key, [b - a for a, b in zip(bounds, bounds[1:])])
    return best[1]


def test_3_1_a_table_of_the_shown_cases_fails_on_the_drawn_ones():
    for _ in range(3):
        fails(EX31, lambda: nb03.check_fastest_balance(shown_table, MEASURED, 2),
              says="KeyError")


@pytest.mark.parametrize("wrong", [first_best_by_sum_of_squares, rest_on_the_last])
def test_3_1_more_wrong_answers_fail(wrong):
    fails(EX31, lambda: nb03.check_fastest_balance(wrong, MEASURED, 2), says="slowest stage")


def test_3_1_balance_with_a_wrong_stage_count_fails():
    message = fails(EX31, lambda: nb03.check_fastest_balance(
        lambda costs, stages: [len(costs)], MEASURED, 2))
    assert "stages" in message


@pytest.mark.parametrize("answer, says", [
    (lambda costs, stages: brute_force(costs, stages)[:-1] + [brute_force(costs, stages)[-1] + 1],
     "covers"),                                        # one layer too many
    (lambda costs, stages: [0] + brute_force(costs, stages - 1), "at least one"),
    (lambda costs, stages: [float(n) for n in brute_force(costs, stages)], "whole number"),
    (lambda costs, stages: {n: n for n in brute_force(costs, stages)}, "return a balance"),
], ids=["a layer too many", "an empty stage", "floats", "a dict"])
def test_3_1_a_malformed_balance_is_told_what_is_wrong_not_a_refused_function(answer, says):
    message = fails(EX31, lambda: nb03.check_fastest_balance(answer, MEASURED, 2), says=says)
    assert "balance_by" not in message and "optimal_split" not in message


@pytest.mark.parametrize("answer", [
    lambda costs, stages: __import__("numpy").array(brute_force(costs, stages)),
    lambda costs, stages: torch.tensor(brute_force(costs, stages)),
    lambda costs, stages: tuple(brute_force(costs, stages)),
], ids=["numpy array", "tensor", "tuple"])
def test_3_1_any_sequence_of_whole_numbers_passes(answer, capsys):
    passes(EX31, lambda: nb03.check_fastest_balance(answer, MEASURED, 2), capsys)


OPTIMAL_SPLIT_COPY, OPTIMAL_SPLIT_SOURCE = copied(optimal_split), copied(optimal_split, "dp")


@pytest.mark.parametrize("copy", [OPTIMAL_SPLIT_COPY, OPTIMAL_SPLIT_SOURCE],
                         ids=["its code object", "its source run again"])
def test_3_1_and_3_2_a_copy_of_optimal_split_fails(copy):
    assert "optimal_split" in fails(EX31, lambda: nb03.check_fastest_balance(
        lambda costs, stages: copy(costs, stages), MEASURED, 2))
    assert "optimal_split" in fails(EX32, lambda: nb03.check_partitioner(
        lambda costs, stages: copy(costs, stages)))


def test_3_2_solution_passes(capsys):
    passes(EX32, lambda: nb03.check_partitioner(bottleneck_search), capsys)


def test_3_2_the_dynamic_program_passes(capsys):
    def dynamic_program(costs, stages):
        prefix = list(itertools.accumulate(costs, initial=0))
        n = len(costs)
        best = {(1, i): (prefix[n] - prefix[i], None) for i in range(n)}
        for s in range(2, stages + 1):
            for i in range(n - s + 1):
                best[s, i] = min((max(prefix[e] - prefix[i], best[s - 1, e][0]), e)
                                 for e in range(i + 1, n - s + 2))
        balance, i = [], 0
        for s in range(stages, 1, -1):
            e = best[s, i][1]
            balance.append(e - i)
            i = e
        return balance + [n - i]
    passes(EX32, lambda: nb03.check_partitioner(dynamic_program), capsys)


@pytest.mark.parametrize("wrong", [last_alone, even_counts, greedy_at_share,
                                   greedy_below_share, smallest_variance, whole_number_search])
def test_3_2_wrong_answers_fail(wrong):
    fails(EX32, lambda: nb03.check_partitioner(wrong))


def packed(costs, limit):
    """Layers packed greedily into consecutive stages that each cost at most ``limit``."""
    balance, load = [0], 0.0
    for c in costs:
        if load + c > limit:
            balance.append(0)
            load = 0.0
        load += c
        balance[-1] += 1
    return balance


def test_3_2_search_that_leaves_stages_empty_fails():
    bounds = {(tuple(costs), k): max(stage_costs(costs, optimal_split(costs, k)))
              for costs in nb03.LONG_COSTS for k in (8, 2, 49)}     # before the check

    def packed_only(costs, stages):      # the greedy packing at the right bound, unsplit
        return packed(costs, bounds[tuple(costs), stages])
    assert "stages" in fails(EX32, lambda: nb03.check_partitioner(packed_only))


def test_3_2_shortcut_fails():
    assert "optimal_split" in fails(EX32, lambda: nb03.check_partitioner(shortcut))
    assert "optimal_split" in fails(EX32, lambda: nb03.check_partitioner(
        lambda costs, stages, _split=optimal_split: _split(costs, stages)))


def test_3_2_a_table_of_the_shown_cases_fails_on_the_drawn_ones():
    table = {(tuple(c), k): optimal_split(list(c), k) for c in nb03.LONG_COSTS
             for k in (8, 2, 49)}
    for _ in range(2):
        fails(EX32, lambda: nb03.check_partitioner(lambda costs, k: table[tuple(costs), k]),
              says="KeyError")


def test_3_2_a_search_over_whole_numbers_only_fails():
    def integer_limits(costs, stages):       # tries limits 1, 2, 3...: fine for whole numbers
        limit = max(costs)
        while len(balance := packed(costs, limit)) > stages:
            limit = math.floor(limit) + 1
        while len(balance) < stages:         # split the largest stage to use every stage
            k = max(range(len(balance)), key=lambda j: balance[j])
            balance[k:k + 1] = [balance[k] - balance[k] // 2, balance[k] // 2]
        return balance
    fails(EX32, lambda: nb03.check_partitioner(integer_limits), says="slowest stage")


def test_3_2_brute_force_runs_out_of_time():
    assert "longer than" in fails(EX32, lambda: nb03.check_partitioner(brute_force,
                                                                        seconds=0.5))


# --------------------------------------------------------------------- 3.3: evaluation

BPTT = 7


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = transformer_lm(40, "cpu", d_model=16, d_hid=32, nlayers=1, nhead=2, dropout=0.1)
    source = torch.randint(40, (3, 4 * BPTT + 2 + 11))
    return model, source


def solution(model, source, bptt):
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, source.size(1) - 1, bptt):
            inputs, targets = get_batch(source, i, bptt)
            total += lm_loss(model(inputs), targets, reduction="sum").item()
            tokens += targets.numel()
    return total / tokens


def batch_mean(model, source, bptt):
    with torch.no_grad():
        return statistics.mean(lm_loss(model(x), y).item() for x, y in
                               (get_batch(source, i, bptt)
                                for i in range(0, source.size(1) - 1, bptt)))


def tutorial_formula(model, source, bptt):
    total = 0.0
    with torch.no_grad():
        for i in range(0, source.size(1) - 1, bptt):
            x, y = get_batch(source, i, bptt)
            total += len(x) * lm_loss(model(x), y).item()
    return total / (source.size(1) - 1)


def drops_the_short_batch(model, source, bptt):
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, source.size(1) - bptt, bptt):
            x, y = get_batch(source, i, bptt)
            if y.size(1) < bptt:
                continue
            total += lm_loss(model(x), y, reduction="sum").item()
            tokens += y.numel()
    return total / tokens


def full_batches_assumed(model, source, bptt):
    total, batches = 0.0, 0
    with torch.no_grad():
        for i in range(0, source.size(1) - 1, bptt):
            x, y = get_batch(source, i, bptt)
            total += lm_loss(model(x), y, reduction="sum").item()
            batches += 1
    return total / (batches * bptt * source.size(0))


def returns_a_tensor(model, source, bptt):
    return torch.tensor(solution(model, source, bptt))


def first_window_only():                       # right for the first window it sees only
    seen = []

    def answer(model, source, bptt):
        seen.append(source)
        return solution(model, source, bptt) if len(seen) == 1 else 0.0
    return answer


def mean_over_rows_then_batches(model, source, bptt):   # each batch's mean, then their mean
    with torch.no_grad():
        means = [lm_loss(model(x), y).item() for x, y in
                 (get_batch(source, i, bptt) for i in range(0, source.size(1) - 1, bptt))]
    return sum(means) / len(means)


def last_column_scored(model, source, bptt):    # i up to source.size(1): one target too many
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, source.size(1), bptt):
            x, y = source[:, i:i + bptt], source[:, i + 1:i + 1 + bptt]
            if x.size(1) != y.size(1):
                raise IndexError("no next word for the last column")
            total += lm_loss(model(x), y, reduction="sum").item()
            tokens += y.numel()
    return total / tokens


def shortcut_evaluate(model, source, bptt):
    return evaluate(model, source, bptt)[0]


def test_3_3_solution_passes(lm, capsys):
    model, source = lm
    model.train()
    passes(EX33, lambda: nb03.check_token_weighted_loss(solution, model, source, BPTT), capsys)
    assert model.training                       # the check restores the mode


@pytest.mark.parametrize("wrong, says", [
    (batch_mean, "mean of the 3 batch means"), (tutorial_formula, "tutorial's formula"),
    (drops_the_short_batch, "Every batch counts"), (full_batches_assumed, "Every batch counts"),
    (returns_a_tensor, "Python float"),
    (first_window_only(), "Every batch counts"),
    (mean_over_rows_then_batches, "mean of the"),
    (last_column_scored, "IndexError")])
def test_3_3_wrong_answers_fail(lm, wrong, says):
    model, source = lm
    assert says in fails(EX33, lambda: nb03.check_token_weighted_loss(wrong, model, source, BPTT))


def test_3_3_shortcut_fails(lm):
    model, source = lm
    assert "evaluate" in fails(EX33, lambda: nb03.check_token_weighted_loss(
        shortcut_evaluate, model, source, BPTT))
    assert "evaluate" in fails(EX33, lambda: nb03.check_token_weighted_loss(
        lambda m, s, b, _e=evaluate: _e(m, s, b)[0], model, source, BPTT))   # a default


def test_3_3_needs_enough_columns(lm):
    model, source = lm
    with pytest.raises(ValueError, match="4 \\* bptt \\+ 2"):
        nb03.check_token_weighted_loss(solution, model, source[:, :10], BPTT)
