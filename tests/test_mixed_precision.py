"""``torch.autocast`` to bfloat16 reaches every stage of a `DistributedPipe`, and
`lm.train --dtype bf16` turns it on. Weights and their gradients stay float32. What
crosses between ranks is what autocast made: bfloat16 out of a matmul (the p2p header
carries the dtype, so the receiver allocates bfloat16), float32 out of the LM's blocks,
which end in a LayerNorm that autocast runs in float32."""
from __future__ import annotations

import pytest
import torch

from dist_worker import batch, tiny_lm, token_loss
from launch_worker import clip_and_bf16_run
from pipeline_lib.lm import train

BF16, FP32 = str(torch.bfloat16), str(torch.float32)


def messages(dtype: str, rank: int, ranks: int = 4) -> tuple[list[str], list[str]]:
    """What pipe rank ``rank`` of ``ranks`` sends and receives, each message of ``dtype``."""
    sent = ([f"activation:{dtype}"] if rank < ranks - 1 else []) + \
        ([f"gradient:{dtype}"] if rank else [])
    received = ([f"activation:{dtype}"] if rank else []) + \
        ([f"gradient:{dtype}"] if rank < ranks - 1 else [])
    return sent, received


@pytest.mark.parametrize("model,dtype", [("linear", BF16), ("lm", FP32)])
def test_messages_carry_autocasts_dtype_and_weights_stay_float32(model, dtype):
    ranks = [torch.load(clip_and_bf16_run() / f"bf16-{model}-rank{r}.pt") for r in range(4)]
    for r, rank in enumerate(ranks):
        assert rank["weights"] == [FP32] and rank["grads"] == [FP32], f"rank {r}"
        assert (sorted(set(rank["sent"])), sorted(set(rank["received"]))) == \
            messages(dtype, r), f"rank {r}"


def test_the_pipelined_lm_under_autocast_computes_the_plain_models_loss():
    loss = torch.load(clip_and_bf16_run() / "bf16-lm-rank3.pt")["loss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = token_loss(tiny_lm()(batch()[0]), batch()[1]).item()
    with torch.no_grad():
        float32 = token_loss(tiny_lm()(batch()[0]), batch()[1]).item()
    assert loss == pytest.approx(want, rel=5e-3)   # micro-batches round differently
    assert loss != float32                         # autocast took effect


@pytest.mark.parametrize("dtype,autocast", [("fp32", False), ("bf16", True)])
def test_the_training_programs_precision(dtype, autocast):
    precision = train._precision(dtype, torch.device("cpu"))
    with precision():
        assert torch.is_autocast_enabled("cpu") == autocast
        if autocast:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
