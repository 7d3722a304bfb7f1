"""The chunked loss spread over devices (``MultiGPULossCompute``): the plain loss's value
and gradients, less memory per device."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib.lm.multi_device_loss import multi_device_loss_backward
from pipeline_lib.memory import PeakTensorMemory

VOCAB, D_MODEL = 50, 8
CPU = torch.device("cpu")


def decoder_and_generator():
    """A one-layer "decoder" (so that the gradient must flow past the decoder output) and
    the generator: the projection to the vocabulary."""
    torch.manual_seed(0)
    return nn.Linear(D_MODEL, D_MODEL), nn.Linear(D_MODEL, VOCAB)


def batch(rows, positions, padding=0):
    torch.manual_seed(1)
    x = torch.randn(rows, positions, D_MODEL)
    target = torch.randint(0, VOCAB, (rows, positions))
    target[-1, positions - padding:] = -100          # the last row's tail is padding
    return x, target


def plain(x, target):
    """The reference: the whole loss on one device, one backward."""
    decoder, generator = decoder_and_generator()
    loss = F.cross_entropy(generator(decoder(x)).flatten(0, 1), target.flatten())
    loss.backward()
    return loss.detach(), decoder, generator


def multi(x, target, devices, chunk, **kwargs):
    decoder, generator = (module.to(devices[0]) for module in decoder_and_generator())
    loss = multi_device_loss_backward(decoder(x.to(devices[0])), generator,
                                      target.to(devices[0]), devices, chunk, **kwargs)
    return loss, decoder, generator


def assert_same_training(got, expected):
    (loss, decoder, generator), (loss0, decoder0, generator0) = got, expected
    torch.testing.assert_close(loss.cpu(), loss0)
    for module, reference in [(decoder, decoder0), (generator, generator0)]:
        for p, q in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, positions, devices, chunk, padding", [
    (4, 6, 2, 3, 0),     # even everywhere
    (5, 7, 2, 3, 0),     # rows 3 + 2, positions 3 + 3 + 1
    (5, 7, 3, 4, 2),     # rows 2 + 2 + 1, positions 4 + 3, padding on the last device
    (2, 5, 3, 10, 5),    # fewer rows than devices, a chunk longer than the rows, and the
                         # last device's only row is all padding
    (3, 4, 1, 1, 1),     # one device, one position per chunk
])
def test_loss_and_gradients_equal_the_plain_loss(rows, positions, devices, chunk, padding):
    x, target = batch(rows, positions, padding)
    assert_same_training(multi(x, target, [CPU] * devices, chunk), plain(x, target))


def test_decoder_output_gradient_equals_the_plain_loss():
    x, target = batch(5, 7, padding=3)
    out = x.clone().requires_grad_()
    generator = decoder_and_generator()[1]
    multi_device_loss_backward(out, generator, target, [CPU] * 2, chunk=2)
    out0 = x.clone().requires_grad_()
    F.cross_entropy(decoder_and_generator()[1](out0).flatten(0, 1), target.flatten()).backward()
    torch.testing.assert_close(out.grad, out0.grad)


def test_gradients_accumulate_like_backward():
    x, target = batch(5, 7)
    decoder, generator = decoder_and_generator()
    for _ in range(2):
        multi_device_loss_backward(decoder(x), generator, target, [CPU] * 2, chunk=3)
    _, decoder0, generator0 = plain(x, target)
    torch.testing.assert_close(generator.weight.grad, 2 * generator0.weight.grad)
    torch.testing.assert_close(decoder.weight.grad, 2 * decoder0.weight.grad)


def test_each_device_peaks_below_the_plain_loss():
    rows, positions, devices = 6, 32, 3
    x, target = batch(rows, positions)
    out = x.requires_grad_()
    with PeakTensorMemory() as memory:
        F.cross_entropy(nn.Linear(D_MODEL, 500)(out).flatten(0, 1), target.flatten()).backward()
    watch = [PeakTensorMemory() for _ in range(devices)]
    multi_device_loss_backward(x.detach().requires_grad_(), nn.Linear(D_MODEL, 500), target,
                               [CPU] * devices, chunk=4, watch=watch)
    logits_bytes = rows * positions * 500 * 4
    for device in watch:
        # a device holds 2 rows x 4 positions of logits at a time, not 6 x 32
        assert 0 < device.peak < memory.peak - logits_bytes


def test_bad_input_is_refused_before_any_work():
    x, target = batch(4, 6)
    generator = decoder_and_generator()[1]
    with pytest.raises(ValueError, match="devices is empty"):
        multi_device_loss_backward(x, generator, target, [], chunk=2)
    with pytest.raises(ValueError, match="positive"):
        multi_device_loss_backward(x, generator, target, [CPU] * 2, chunk=0)
    with pytest.raises(ValueError, match="disagree"):
        multi_device_loss_backward(x, generator, target[:3], [CPU] * 2, chunk=2)
    with pytest.raises(ValueError, match="one per device"):
        multi_device_loss_backward(x, generator, target, [CPU] * 2, chunk=2,
                                   watch=[PeakTensorMemory()])
    with pytest.raises(ValueError, match="every target is ignore_index"):
        multi_device_loss_backward(x, generator, torch.full_like(target, -100), [CPU] * 2, 2)
    assert generator.weight.grad is None


def test_a_failing_device_is_named():
    x, target = batch(4, 6)
    target[3, 0] = VOCAB                     # out of range, on the second device's rows
    with pytest.raises(RuntimeError, match="replica 1"):
        multi_device_loss_backward(x, decoder_and_generator()[1], target, [CPU] * 2, 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_on_gpus():
    x, target = batch(5, 7, padding=2)
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    assert_same_training(multi(x, target, gpus, chunk=3), plain(x, target))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_and_the_cpu():
    x, target = batch(5, 7, padding=2)
    devices = [torch.device("cuda", 0), CPU]
    assert_same_training(multi(x, target, devices, chunk=3), plain(x, target))
