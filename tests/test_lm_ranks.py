"""What each rank of `lm.train` holds and sends: only its own layers (with the weights the
whole model gets from the same seed), and activations as device tensors."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
import torch

from pipeline_lib.lm import pipeline_eval
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.schedules import build


def test_a_rank_builds_its_layers_only_with_the_whole_models_weights():
    """The layers kept are those of `transformer_lm` with everything built, from the same
    seed; the others are shapes on the meta device; the generator ends where the whole
    build leaves it, so what is drawn next (dropout, step seeds) agrees too."""
    torch.manual_seed(3)
    whole = transformer_lm(50, nlayers=3)
    after_whole = torch.rand(4)
    torch.manual_seed(3)
    mine = transformer_lm(50, nlayers=3, layers={1, 4})
    assert torch.equal(torch.rand(4), after_whole)
    for i, (a, b) in enumerate(zip(whole, mine)):
        if i in (1, 4):
            for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
                assert torch.equal(x, y), f"layer {i}: {name}"
        else:
            assert all(t.is_meta for t in [*b.parameters(), *b.buffers()]), f"layer {i}"
    assert [type(layer) for layer in mine] == [type(layer) for layer in whole]


class Wire:
    """`torch.distributed.send` and `recv` between ranks run one after another in this
    process; object lists (pickles through the CPU) refused."""

    def __init__(self) -> None:
        self.queue: deque[torch.Tensor] = deque()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.queue.append(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        sent = self.queue.popleft()
        assert (sent.dtype, sent.shape) == (tensor.dtype, tensor.shape)
        tensor.copy_(sent)

    @staticmethod
    def refuse(*args, **kwargs):
        raise AssertionError("an activation was pickled through the CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_evaluation_sends_each_activation_as_a_tensor(monkeypatch, dtype):
    wire = Wire()
    for name, fn in (("send", wire.send), ("recv", wire.recv),
                     ("send_object_list", wire.refuse), ("recv_object_list", wire.refuse)):
        monkeypatch.setattr(pipeline_eval.dist, name, fn)
    torch.manual_seed(0)
    model = transformer_lm(50, nlayers=2, dropout=0.0).eval().to(dtype)
    schedule = build("gpipe", 2, 1)
    pipe = SimpleNamespace(schedule=schedule, mesh=SimpleNamespace(
        device=torch.device("cpu"), global_rank=lambda pipe_rank: pipe_rank))
    inputs = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        assert pipeline_eval._forward_stages(pipe, {0: model[:2]}, inputs) is None
        out = pipeline_eval._forward_stages(pipe, {1: model[2:]}, inputs)
        torch.testing.assert_close(out, model(inputs))
    assert not wire.queue
