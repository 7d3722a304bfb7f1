"""`course.timing`: runs take turns, the order alternates, the warm-up turn is dropped."""
from __future__ import annotations

import pytest

from pipeline_lib.course.timing import machine_load, median_seconds, median_turn, take_turns


def test_turns_alternate_and_the_warm_up_is_dropped():
    order: list[str] = []
    runs = {name: (lambda name=name: order.append(name) or len(order)) for name in "ab"}
    kept = take_turns(runs, 3)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [result for _, result in kept["a"]] == [4, 5, 8]     # turn 0 (call 1) dropped
    assert all(seconds >= 0 for seconds, _ in kept["b"])


def test_median_turn_takes_the_shorter_middle():
    turns = [(3.0, "c"), (1.0, "a"), (2.0, "b"), (4.0, "d")]
    assert median_turn(turns) == (2.0, "b")
    assert median_seconds(turns) == 2.5


@pytest.mark.parametrize("call", [lambda: take_turns({"a": int}, 0), lambda: take_turns({}, 1),
                                  lambda: median_turn([])])
def test_bad_input_is_refused(call):
    with pytest.raises(ValueError):
        call()


def test_machine_load_names_the_cores():
    assert "cores" in machine_load()


def test_loss_seconds_times_the_loss_backward_on_random_logits():
    """It calls the loss once per repeat plus a warm-up, each time with fresh logits that
    need grad, and returns a positive median."""
    import torch

    from pipeline_lib.course.timing import loss_seconds

    calls = []

    def loss_fn(logits, target):
        calls.append((logits.shape, logits.requires_grad, logits.is_leaf))
        return torch.nn.functional.cross_entropy(logits.view(-1, 7), target.reshape(-1))

    seconds = loss_seconds(loss_fn, torch.randint(7, (3, 5)), 7, "cpu", repeats=4)
    assert seconds > 0 and calls == [((3, 5, 7), True, True)] * 5
