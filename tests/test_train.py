import math

import pytest
import torch

from pipeline_lib.lm.data import batchify, load_wikitext2
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.lm.loops import (evaluate, fit, lm_loss, lr_at, make_step, seed_everything,
                                   train_epoch)

from conftest import MINI, needs_mini

V = 50
TINY = dict(d_model=16, nhead=2, d_hid=32, nlayers=2)


@pytest.fixture
def counting_source():
    """4 rows x 11 columns of consecutive integers, so every target is its input + 1."""
    return batchify(torch.arange(44), 4)


def test_lm_loss_is_mean_negative_log_likelihood():
    logits = torch.randn(2, 3, V)
    target = torch.randint(0, V, (2, 3))
    log_probs = logits.log_softmax(-1).gather(-1, target.unsqueeze(-1))
    torch.testing.assert_close(lm_loss(logits, target), -log_probs.mean())
    torch.testing.assert_close(lm_loss(logits, target, reduction="sum"), -log_probs.sum())
    with pytest.raises(ValueError, match=r"logits \[B, T, V\] for target \[B, T\]"):
        lm_loss(logits.transpose(0, 1), target)


def test_evaluate_weights_every_target_token_equally(counting_source):
    bptt = 4  # batches of 4, 4 and 2 columns: 16 + 16 + 8 target tokens

    def model(inputs):  # uniform guess on full batches, near-certain truth on the short one
        if inputs.size(1) == bptt:
            return torch.zeros(*inputs.shape, V)
        return 100.0 * torch.nn.functional.one_hot(inputs + 1, V).float()

    loss, ppl = evaluate(model, counting_source, bptt)
    assert loss == pytest.approx((32 * math.log(V) + 8 * 0.0) / 40)  # not the batch mean 2/3 ln V
    assert ppl == pytest.approx(math.exp(loss))


def test_evaluate_restores_mode_and_builds_no_graph(counting_source):
    torch.manual_seed(0)
    model = transformer_lm(V, **TINY)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append((m.training, out.requires_grad)))
    evaluate(model, counting_source, 4)
    assert model.training and seen and all(s == (False, False) for s in seen)
    model.eval()
    evaluate(model, counting_source, 4)
    assert not model.training


def test_evaluate_on_a_rank_without_logits(counting_source):
    loss, ppl = evaluate(lambda inputs: None, counting_source, 4)
    assert math.isnan(loss) and math.isnan(ppl)


def test_train_epoch_drives_any_step_callable(counting_source):
    calls = []

    def step(inputs, targets):
        calls.append(tuple(inputs.shape))
        assert torch.equal(targets, inputs + 1)
        return torch.tensor(float(len(calls)))

    assert train_epoch(step, counting_source, 4, progress=False) == [1.0, 2.0, 3.0]
    assert calls == [(4, 4), (4, 4), (4, 2)]
    assert len(train_epoch(step, counting_source, 4, max_steps=2, progress=False)) == 2
    # A pipeline rank that never sees the loss returns None: nothing is recorded.
    assert train_epoch(lambda x, y: None, counting_source, 4, progress=False) == []


def test_train_epoch_explains_missing_optimizer_and_divergence(counting_source):
    model = transformer_lm(V, **TINY)
    with pytest.raises(TypeError, match="no optimizer"):
        train_epoch(model, counting_source, 4)
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        train_epoch(lambda x, y: torch.tensor(math.nan), counting_source, 4, progress=False)
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        train_epoch(lambda x, y: 0.0, counting_source, 4, max_steps=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="returned None instead of logits"):
        train_epoch(lambda inputs: None, counting_source, 4, optimizer, progress=False)


def test_make_step_clips_the_update(counting_source):
    torch.manual_seed(0)
    model = transformer_lm(V, **TINY)
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=1.0), clip=1e-3)
    step(counting_source[:, :4], counting_source[:, 1:5])
    after = torch.nn.utils.parameters_to_vector(model.parameters())
    assert (after - before).norm().item() == pytest.approx(1e-3, rel=1e-3)  # lr * clipped grad


def test_fit_is_reproducible():
    stream = torch.randint(0, V, (2000,), generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        seed_everything(0)
        model = transformer_lm(V, **TINY)
        runs.append(fit(model, batchify(stream, 8), batchify(stream[:400], 4), bptt=16,
                        epochs=2, max_steps=3, progress=False))
    first, second = runs
    assert [s.epoch for s in first] == [1, 2]
    for a, b in zip(first, second):
        assert (a.train_loss, a.valid_loss) == (b.train_loss, b.valid_loss)
        assert a.valid_ppl == pytest.approx(math.exp(a.valid_loss))


@needs_mini
def test_cpu_preset_learns_on_mini_wikitext2():
    ds = load_wikitext2(MINI)
    seed_everything(0)
    model = transformer_lm(len(ds.vocab), preset="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = train_epoch(model, batchify(ds.train, 8), 35, optimizer, max_steps=30, progress=False)
    chance = math.log(len(ds.vocab))  # loss of a uniform guess
    assert abs(losses[0] - chance) < 0.5
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5


def test_lr_warms_up_linearly_then_decays_to_the_floor():
    peak, warmup, total = 1e-3, 4, 20
    rates = [lr_at(step, peak, warmup, total, floor=0.1) for step in range(total)]
    assert rates[:warmup] == pytest.approx([peak / 4, peak / 2, 3 * peak / 4, peak])
    assert rates[warmup] == pytest.approx(peak)
    assert all(a > b for a, b in zip(rates[warmup:], rates[warmup + 1:]))   # decays
    assert rates[-1] == pytest.approx(0.1 * peak)
    middle = warmup + (total - warmup - 1) / 2    # a cosine: halfway at the middle
    assert lr_at(int(middle), peak, warmup, total) > 0.55 * peak > lr_at(int(middle) + 1, peak, warmup, total)


def test_lr_without_warmup_starts_at_the_peak():
    assert lr_at(0, 1e-3, 0, 10) == pytest.approx(1e-3)
