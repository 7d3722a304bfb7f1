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


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_padding_counts_for_nothing_as_in_cross_entropy(chunk):
    model = tiny_model()
    features = torch.randn(3, 7, 16, requires_grad=True)
    target = torch.randint(0, VOCAB, (3, 7))
    target[1, 4:] = -100
    target[2, :] = -100
    loss = chunked_loss_backward(features, model[-1], target, chunk)
    reference = tiny_model()
    features0 = features.detach().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference[-1](features0).flatten(0, 1),
                                                 target.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(features.grad, features0.grad)
    for p, q in zip(model[-1].parameters(), reference[-1].parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_batch_of_padding_only_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="every target is ignore_index"):
        chunked_loss_backward(torch.randn(2, 3, 16), model[-1],
                              torch.full((2, 3), -100), chunk=2)


def test_an_empty_batch_is_named_as_empty():
    """It said "every target is ignore_index" of a batch with no target at all."""
    model = tiny_model()
    for shape in [(0, 3), (2, 0)]:
        with pytest.raises(ValueError, match=r"the batch is empty \(target of shape"):
            chunked_loss_backward(torch.randn(*shape, 16), model[-1],
                                  torch.zeros(shape, dtype=torch.long), chunk=2)


def test_a_chunk_that_is_not_an_int_is_named():
    with pytest.raises(ValueError, match=r"chunk must be a positive number of positions "
                                         r"\(an int\), got 1.5"):
        chunked_loss_backward(torch.randn(2, 3, 16), tiny_model()[-1],
                              torch.zeros(2, 3, dtype=torch.long), chunk=1.5)
