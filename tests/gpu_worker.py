"""One rank of `test_gpu.py`'s NCCL test, which launches two with torchrun.

Each rank takes its own GPU, so `process_group` picks NCCL, and runs one 1F1B step of
`DistributedPipe` on a tiny language model, without and with dropout, saving its loss
and gradients (by the full model's parameter names) to ``--out``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline_lib.distributed import DistributedPipe, init_mesh, process_group
from pipeline_lib.lm.model import transformer_lm

VOCAB, ROWS, SEQ, MICROBATCHES, BALANCE = 50, 12, 10, 4, [4, 4]
DROPOUTS = (0.0, 0.2)


def tiny_lm(dropout: float = 0.0) -> nn.Sequential:
    """8 layers: embedding, 6 blocks, decoder."""
    torch.manual_seed(0)
    return transformer_lm(VOCAB, d_model=32, nhead=2, d_hid=64, nlayers=6, dropout=dropout)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    with process_group(timeout=60):
        if dist.get_backend() != "nccl":
            raise RuntimeError(f"expected NCCL, got {dist.get_backend()}: does every "
                               f"worker have a GPU?")
        mesh = init_mesh(2, timeout=60)
        inputs, target = batch()
        for dropout in DROPOUTS:
            model = tiny_lm(dropout)
            names = {id(p): n for n, p in model.named_parameters()}
            pipe = DistributedPipe(model, mesh, BALANCE, MICROBATCHES, "1f1b")
            loss = pipe.step(inputs, target, token_loss)
            torch.save({"loss": None if loss is None else loss.item(),
                        "grads": {names[id(p)]: p.grad.cpu() for p in pipe.parameters()}},
                       out / f"dropout{dropout}-rank{mesh.rank}.pt")


if __name__ == "__main__":
    main()
