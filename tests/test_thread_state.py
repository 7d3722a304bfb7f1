"""The caller's thread-local modes reach the threads that compute for it: under
``torch.autocast`` a `Pipe` and `parallel_apply` compute what the plain model computes
under it, and saved-tensor hooks (``save_on_cpu``) pack what stage threads save.

Issue 25 item 2: stage threads received only grad mode and the thread count, so
``pipe(x)`` returned float32 where the plain model returned bfloat16.

The references run the plain model on the same micro-batches (`microbatched`), so that
they round in bfloat16 exactly where the pipeline does: the comparisons can then be
tight, and computing in float32 instead is far outside them.
"""
import threading

import pytest
import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.course.data_parallel import parallel_apply
from pipeline_lib.schedules import BUILDERS
from conftest import assert_same_grads
from workloads import BALANCES, data, make_model

CHUNKS = 4
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def microbatched(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The plain model's output, one micro-batch at a time, as a Pipe splits the batch."""
    return torch.cat([model(part) for part in x.tensor_split(CHUNKS)])


def microbatched_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What `Pipe.step` computes with a mean loss: each micro-batch's loss weighted by
    its share of the rows, backpropagated on its own. Returns the batch's loss."""
    total = torch.zeros(())
    for part, target in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS)):
        loss = nn.functional.cross_entropy(model(part), target) * (len(part) / len(x))
        loss.backward()
        total += loss.detach()
    return total


@pytest.mark.parametrize("schedule", sorted(BUILDERS))
def test_step_under_autocast_computes_what_the_plain_model_does_under_it(schedule):
    x, y = data(8)
    reference, model = make_model(), make_model()
    with torch.autocast(**BF16):
        expected = microbatched_step(reference, x, y)
        pipe = Pipe(model, chunks=CHUNKS, checkpoint="except_last", balance=BALANCES[4])
        loss = pipe.step(x, y, nn.CrossEntropyLoss(), schedule)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(model, reference)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_pipe_x_under_autocast_returns_the_plain_dtype_and_values(checkpoint):
    """The backward runs outside the autocast block, as PyTorch recommends: a checkpointed
    forward is replayed under the autocast of its first run, or its gradients would be
    float32's. Without the cache of weight casts: with it, the plain model's micro-batches
    share one bfloat16 copy of each weight and sum its gradients in bfloat16, where the
    pipeline's separate backwards sum them in float32."""
    x, y = data(8)
    reference, model = make_model(), make_model()
    pipe = Pipe(model, chunks=CHUNKS, checkpoint=checkpoint, balance=BALANCES[3])
    with torch.autocast(**BF16, cache_enabled=False):
        expected = microbatched(reference, x)
        out = pipe(x)
        expected_loss = nn.functional.cross_entropy(expected, y)
        loss = nn.functional.cross_entropy(out, y)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    expected_loss.backward()
    loss.backward()
    assert_same_grads(model, reference)


def test_autocast_off_inside_an_autocast_block_stays_off():
    x, _ = data(8)
    pipe = Pipe(make_model(), chunks=CHUNKS, balance=BALANCES[2])
    with torch.autocast(**BF16), torch.autocast("cpu", enabled=False):
        assert pipe(x).dtype == torch.float32


class CountedSaveOnCpu:
    """``torch.autograd.graph.save_on_cpu``'s hooks, counting what they pack (and on
    which thread) and unpack."""

    def __init__(self):
        self.offload = torch.autograd.graph.save_on_cpu()
        self.packed_on: list[str] = []
        self.unpacked = 0
        self.lock = threading.Lock()

    def pack(self, tensor):
        with self.lock:
            self.packed_on.append(threading.current_thread().name)
        return self.offload.pack_hook(tensor)

    def unpack(self, packed):
        with self.lock:
            self.unpacked += 1
        return self.offload.unpack_hook(packed)

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@pytest.mark.parametrize("call", ["step", "pipe(x)"])
def test_save_on_cpu_packs_what_stage_threads_save(call):
    x, y = data(8)
    reference, model = make_model(), make_model()
    nn.functional.cross_entropy(reference(x), y).backward()
    pipe = Pipe(model, chunks=CHUNKS, checkpoint="never", balance=BALANCES[2])
    hooks = CountedSaveOnCpu()
    with hooks():
        if call == "step":
            pipe.step(x, y, nn.CrossEntropyLoss(), "1f1b")
        else:
            out = pipe(x)
    if call == "pipe(x)":
        nn.functional.cross_entropy(out, y).backward()
    assert hooks.packed_on, "nothing the stages saved was packed by the caller's hooks"
    assert {name.rsplit("rank", 1)[0] for name in hooks.packed_on} == {"pipeline-"}
    assert hooks.unpacked == len(hooks.packed_on)
    assert_same_grads(model, reference)


class ModeSpy(nn.Module):
    """Records the modes each forward ran in."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def forward(self, x):
        self.seen.add((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return x


def test_pipe_x_under_inference_mode_runs_its_stages_in_it():
    """Tensors made in inference mode carry no version counter and no autograd
    metadata: the stages make them, as the plain model does."""
    x, _ = data(8)
    spy = ModeSpy()
    model = nn.Sequential(*make_model()[:4], spy, *make_model()[4:])
    with torch.inference_mode():
        expected, out = model(x), Pipe(model, chunks=CHUNKS, balance=[4, 6])(x)
    assert spy.seen == {(True, False)}
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_autocast_holds_and_save_on_cpu_moves_what_stages_save_to_the_cpu():
    """Where mixed precision and offloading matter: the stage threads compute in
    bfloat16 and their saved tensors wait for the backward on the CPU."""
    gpu = torch.device("cuda", 0)
    x, y = (t.to(gpu) for t in data(8))
    reference, model = make_model().to(gpu), make_model().to(gpu)
    pipe = Pipe(model, chunks=CHUNKS, checkpoint="never", balance=BALANCES[2])
    offload = torch.autograd.graph.save_on_cpu()
    offloaded_to = []

    def pack(tensor):
        device, stored = offload.pack_hook(tensor)
        offloaded_to.append((device.type, stored.device.type))
        return device, stored

    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):   # (see above)
        expected = microbatched(reference, x)
        with torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack_hook):
            out = pipe(x)
        loss, expected_loss = (nn.functional.cross_entropy(o, y) for o in (out, expected))
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    assert offloaded_to and set(offloaded_to) == {("cuda", "cpu")}
    loss.backward()
    expected_loss.backward()
    assert_same_grads(model, reference, rtol=1e-3, atol=1e-4)


# -- parallel_apply ---------------------------------------------------------------------

def test_parallel_apply_under_autocast_computes_what_each_module_does_under_it():
    x, _ = data(8)
    modules = [make_model(), make_model()]
    parts = list(x.tensor_split(2))
    with torch.autocast(**BF16):
        outputs = parallel_apply(modules, parts)
        expected = [m(p) for m, p in zip(modules, parts)]
    for out, want in zip(outputs, expected):
        assert out.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_parallel_apply_packs_with_the_callers_saved_tensor_hooks():
    x, y = data(8)
    modules = [make_model(), make_model()]
    hooks = CountedSaveOnCpu()
    with hooks():
        outputs = parallel_apply(modules, list(x.tensor_split(2)))
    assert hooks.packed_on and threading.current_thread().name not in hooks.packed_on
    nn.functional.cross_entropy(torch.cat(outputs), y).backward()
    assert hooks.unpacked == len(hooks.packed_on)
