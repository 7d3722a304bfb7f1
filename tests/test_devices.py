"""Placing stages (WithDevice, index-less GPUs), copying between GPUs, and handing shared
tensors to every micro-batch (NoChunk).

No GPU here: the CUDA calls are faked to check what `transfer` asks of them; that the
copies really are safe is `test_gpu.py`'s job.
"""
import contextlib
import copy
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

from pipeline_lib import NoChunk, Pipe, WithDevice, devices, tree
from pipeline_lib.devices import stage_devices, transfer

META, CPU = torch.device("meta"), torch.device("cpu")
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_with_device_places_a_parameterless_stage_and_those_after_it():
    # "meta" stands for a second device here: placement only, nothing runs on it
    model = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "meta"), nn.Tanh(),
                          WithDevice(nn.Linear(2, 2), "cpu"))
    pipe = Pipe(model)
    assert pipe.devices == [CPU, META, META, CPU]


def test_with_device_moves_a_layer_with_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), WithDevice(nn.Linear(2, 2), "meta"))
    pipe = Pipe(model, balance=[2, 1])
    assert pipe.devices == [CPU, META]
    assert model[2].module.weight.device == META


def test_with_device_conflicts_are_clear_errors():
    model = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "meta"))
    with pytest.raises(ValueError, match=r"stage 1 holds a layer pinned by WithDevice to "
                                         r"meta, but devices\[1\] is cpu"):
        Pipe(model, devices=["cpu", "cpu"])
    two_pins = nn.Sequential(WithDevice(nn.ReLU(), "meta"), WithDevice(nn.Tanh(), "cpu"))
    with pytest.raises(ValueError, match=r"pinned by WithDevice to different devices "
                                         r"\['cpu', 'meta'\]"):
        Pipe(two_pins, balance=[2])


def test_with_device_is_transparent():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    wrapped = copy.deepcopy(model)
    wrapped[1] = WithDevice(wrapped[1], "cpu")
    x = torch.randn(6, 3)
    torch.testing.assert_close(Pipe(wrapped, chunks=3)(x), model(x))


def fake_gpus(monkeypatch, count: int = 2, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_index_less_cuda_becomes_the_current_gpu(monkeypatch):
    """"cuda" must equal the device its tensors report ("cuda:1" here), else `transfer`
    copies every time and ``torch.cuda.set_device`` refuses it."""
    fake_gpus(monkeypatch, current=1)
    stages = [nn.Linear(2, 2), nn.Tanh(), WithDevice(nn.ReLU(), "cuda")]
    assert stage_devices(stages, ["cuda", "cuda:0", "cuda:1"]) == [GPU1, GPU0, GPU1]


def test_a_gpu_the_machine_lacks_is_a_clear_error(monkeypatch):
    fake_gpus(monkeypatch)
    with pytest.raises(ValueError, match=r"devices\[1\] is cuda:2, but this machine has 2 "
                                         r"GPU\(s\); give cuda:0 to cuda:1"):
        stage_devices([nn.Tanh(), nn.Tanh()], ["cuda:0", "cuda:2"])


class FakeStream:
    def __init__(self, device: torch.device):
        self.device, self.waits_for = device, []

    def wait_stream(self, other: "FakeStream") -> None:
        self.waits_for.append(other)


def test_a_copy_between_gpus_runs_on_side_streams_and_records_both_tensors(monkeypatch):
    """Each GPU has one side stream, made once; the copy runs on both GPUs' side streams,
    the source is recorded on the stream that reads it (the source's side stream), the
    copy on the stream that will read it (the target's compute stream)."""
    made, active, compute = [], [], {d: FakeStream(d) for d in (GPU0, GPU1)}

    def new_stream(device):
        made.append(FakeStream(device))
        return made[-1]

    @contextlib.contextmanager
    def use(stream):
        active.append(stream)
        yield
        active.pop()

    monkeypatch.setattr(devices, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", compute.__getitem__)
    monkeypatch.setattr(torch.cuda, "stream", use)
    for _ in range(3):
        source = mock.Mock(spec=Tensor, is_cuda=True, device=GPU0)
        moved = mock.Mock(spec=Tensor)
        copied_on = []
        source.to.side_effect = lambda *args, **kwargs: copied_on.append(list(active)) or moved
        assert transfer(source, GPU1) is moved
    assert [s.device for s in made] == [GPU0, GPU1], "one side stream per GPU, made once"
    side0, side1 = made
    assert copied_on == [[side0, side1]]
    source.record_stream.assert_called_once_with(side0)
    moved.record_stream.assert_called_once_with(compute[GPU1])
    assert compute[GPU0] in side0.waits_for and side1 in compute[GPU1].waits_for


class Masked(nn.Module):
    """Multiplies by a feature mask shared by all rows; records the masks it was given."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.masks_seen = []

    def forward(self, inputs):
        x, mask = inputs
        self.masks_seen.append(mask)
        return self.linear(x) * mask, mask


class DropMask(nn.Module):
    def forward(self, inputs):
        return inputs[0]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Masked(), Masked(), DropMask(), nn.Linear(4, 3))


@pytest.mark.parametrize("run", ["forward", "step"])
def test_nochunk_gives_the_whole_tensor_to_every_micro_batch(run):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.5])   # 4 entries: not split over the 10 rows
    reference = make_model()
    expected = nn.functional.cross_entropy(reference((x, mask)), y)
    expected.backward()

    model = make_model()
    pipe = Pipe(model, chunks=5, checkpoint="never", balance=[1, 1, 2])
    if run == "forward":
        loss = nn.functional.cross_entropy(pipe((x, NoChunk(mask))), y)
        loss.backward()
    else:
        loss = pipe.step((x, NoChunk(mask)), y, nn.CrossEntropyLoss())
    torch.testing.assert_close(loss.detach(), expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for layer in model[:2]:
        assert len(layer.masks_seen) == 5
        assert all(torch.equal(seen, mask) for seen in layer.masks_seen)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        pipe((x, mask))   # unwrapped, the mask would be split like the batch


def test_transfer_moves_every_tensor_of_a_tree():
    x, ids = torch.randn(2), torch.arange(2)
    moved = transfer({"x": x, "rest": (ids, "flag")}, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["rest"][0].device.type == "meta"
    assert moved["rest"][0].dtype == torch.int64 and moved["rest"][1] == "flag"


def test_a_copy_from_the_cpu_to_a_gpu_is_pinned_and_does_not_block(monkeypatch):
    """From pageable memory the host would wait while the driver stages the copy: the
    tensor is pinned first (unless it is already), then copied with non_blocking=True on
    the target's current stream (no side stream: the stage reads it next)."""
    monkeypatch.setattr(torch.cuda, "stream", mock.Mock(side_effect=AssertionError))
    for already_pinned in (False, True):
        source = mock.Mock(spec=Tensor, device=CPU, is_cuda=False)
        source.is_pinned.return_value = already_pinned
        page_locked = source if already_pinned else mock.Mock(spec=Tensor, device=CPU)
        source.pin_memory.return_value = page_locked
        moved = mock.Mock(spec=Tensor)
        page_locked.to.return_value = moved
        assert transfer(source, GPU1) is moved
        page_locked.to.assert_called_once_with(GPU1, non_blocking=True)
        assert source.pin_memory.call_count == (0 if already_pinned else 1)


def test_a_step_pins_its_microbatches_once(monkeypatch):
    """`split_batch(..., pin=True)` (a stage on a GPU) pins every micro-batch's CPU
    tensors once per step, inputs and targets, trees included; without it, nothing."""
    from pipeline_lib.step import split_batch

    pinned_ids = set()

    def pin_memory(t):
        copy = t.clone()
        pinned_ids.add(id(copy))
        return copy

    monkeypatch.setattr(Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(Tensor, "is_pinned", lambda t: id(t) in pinned_ids)
    x, y = {"ids": torch.arange(8), "mask": NoChunk(torch.ones(3))}, torch.arange(8.0)
    micro_in, micro_target, _ = split_batch(x, y, 4, pin=True)
    leaves = [t for m in micro_in + micro_target for t in tree.tensors(m)]
    assert len(leaves) == 12 and all(t.is_pinned() for t in leaves)
    assert len(pinned_ids) == 12
    micro_in, _, _ = split_batch(x, y, 4)
    assert not any(t.is_pinned() for m in micro_in for t in tree.tensors(m))


def test_a_step_reads_a_gpu_tensor_back_through_pinned_memory_and_an_event(monkeypatch):
    """`read_back` copies without blocking into page-locked memory and waits for an event
    recorded after the copy on the values' stream: a synchronising ``.tolist()`` would
    wait for the same work, but trip ``torch.cuda.set_sync_debug_mode``."""
    values = mock.Mock(spec=Tensor, device=GPU1, shape=(2,), dtype=torch.float64)
    host = mock.Mock(spec=Tensor)
    host.tolist.return_value = [1.0, 0.0]
    empty = mock.Mock(return_value=host)
    event = mock.Mock()
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", mock.Mock(return_value=event))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    assert devices.read_back(values) == [1.0, 0.0]
    empty.assert_called_once_with((2,), dtype=torch.float64, pin_memory=True)
    host.copy_.assert_called_once_with(values, non_blocking=True)
    event.record.assert_called_once_with(f"stream of {GPU1}")
    event.synchronize.assert_called_once_with()
    values.tolist.assert_not_called()
