"""The two ways of giving a micro-batch its random stream draw the same numbers."""
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline_lib import rng
from pipeline_lib.rng import microbatch_rng, owned_rng


def draws() -> list[torch.Tensor]:
    x = torch.ones(64)
    return [F.dropout(x, 0.5), F.rrelu(-x, training=True), torch.empty(3).uniform_(),
            torch.rand(3), torch.randn(2, 2), torch.randint(0, 9, (4,))]


def test_owned_rng_draws_what_microbatch_rng_draws_and_replays():
    torch.manual_seed(123)
    with microbatch_rng(7):
        private = draws()
    for _ in range(2):   # entering again with the same seed replays
        with owned_rng(7):
            owned = draws()
        assert all(torch.equal(a, b) for a, b in zip(private, owned))
    with owned_rng(8):
        other = draws()
    assert not torch.equal(private[1], other[1])


def test_owned_rng_leaves_the_global_generator_as_it_was():
    torch.manual_seed(0)
    expected = torch.rand(5)
    torch.manual_seed(0)
    with owned_rng(7):
        torch.rand(100)
    assert torch.equal(torch.rand(5), expected)


def run_while_locked(work: Callable[[], None]) -> None:
    """Run ``work`` on another thread while this one holds the streams' lock."""
    with rng._LOCK:
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), f"{work.__name__} waited for the stream lock"


def test_cpu_dropout_matches_pytorch_and_takes_no_lock():
    """Stage threads draw CPU dropout masks at the same time: with the lock held
    elsewhere, a stream still draws, and draws what PyTorch's own dropout would."""
    x = torch.randn(8, 16)
    with owned_rng(3):
        expected = [F.dropout(x.clone(), 0.3, True, inplace) for inplace in (False, True)]
    result: list[torch.Tensor] = []

    def draw() -> None:
        with microbatch_rng(3):
            result.extend(F.dropout(x.clone(), 0.3, True, inplace) for inplace in (False, True))

    run_while_locked(draw)
    assert len(result) == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, result))


def test_dropout_in_evaluation_draws_nothing_and_takes_no_lock():
    x = torch.randn(8, 16)
    outputs: list[torch.Tensor] = []

    def evaluate() -> None:
        with microbatch_rng(3):
            outputs.append(F.dropout(x, 0.3, training=False))
            outputs.append(F.dropout(x, 0.0))

    run_while_locked(evaluate)
    assert len(outputs) == 2 and all(torch.equal(o, x) for o in outputs)


def test_attention_dropout_matches_pytorch_and_takes_no_lock():
    """An attention with dropout draws its mask inside `F.multi_head_attention_forward`
    (in scaled_dot_product_attention, or on the returned weights); its projections and
    its mask run while another stage thread holds the lock."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
    x = torch.randn(3, 5, 16)

    def attend() -> list[torch.Tensor]:
        return [attention(x, x, x, need_weights=weights)[0] for weights in (False, True)]

    with owned_rng(4):
        expected = attend()
    result: list[torch.Tensor] = []

    def attend_on_stream() -> None:
        with microbatch_rng(4):
            result.extend(attend())

    run_while_locked(attend_on_stream)
    assert len(result) == 2 and all(torch.equal(a, b) for a, b in zip(expected, result))
    assert not torch.equal(expected[0], attend()[0])
