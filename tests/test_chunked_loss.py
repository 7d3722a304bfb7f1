"""The chunked projection and loss: same loss and gradients as the plain one, less
memory."""
import pytest
import torch

from pipeline_lib.lm.chunked_loss import chunked_loss_backward, lm_backward
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.memory import PeakTensorMemory

VOCAB = 500


def tiny_model():
    torch.manual_seed(0)
    return transformer_lm(VOCAB, d_model=16, nhead=2, d_hid=32, nlayers=1, dropout=0.0)


def run(chunk, inputs, targets):
    model = tiny_model()
    with PeakTensorMemory() as memory:
        loss = lm_backward(model, inputs, targets, chunk)
    return loss, {n: p.grad for n, p in model.named_parameters()}, memory.peak


@pytest.mark.parametrize("chunk", [1, 3, 5, 10, 64])
def test_chunked_loss_and_gradients_equal_unchunked(chunk):
    inputs, targets = torch.randint(0, VOCAB, (2, 3, 10))
    loss, grads, _ = run(None, inputs, targets)
    chunked_loss, chunked_grads, _ = run(chunk, inputs, targets)
    torch.testing.assert_close(chunked_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7)


def test_chunking_lowers_the_peak_by_about_the_logits():
    inputs, targets = torch.randint(0, VOCAB, (2, 4, 32))
    logits_bytes = 4 * 32 * VOCAB * 4
    _, _, plain = run(None, inputs, targets)
    _, _, chunked = run(4, inputs, targets)
    assert plain - chunked > 2 * logits_bytes * (1 - 4 / 32)


def test_chunked_loss_rejects_bad_input():
    model = tiny_model()
    features = model[:-1](torch.randint(0, VOCAB, (2, 5)))
    with pytest.raises(ValueError, match="positive"):
        chunked_loss_backward(features, model[-1], torch.zeros(2, 5, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_loss_backward(features, model[-1], torch.zeros(2, 4, dtype=torch.long), 2)
