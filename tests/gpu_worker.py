"""One rank of `test_gpu.py`'s NCCL test, which launches two with torchrun.

Each rank takes its own GPU, so `process_group` picks NCCL, and runs one 1F1B step of
`DistributedPipe` on `dist_worker`'s tiny language model (whose own launches use gloo),
without and with dropout, saving its loss and gradients (by the full model's parameter
names) to ``--out``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from dist_worker import DROPOUT, MICROBATCHES, batch, tiny_lm, token_loss
from pipeline_lib.distributed import DistributedPipe, init_mesh, process_group

BALANCE = [4, 4]   # tiny_lm's 8 layers on 2 ranks
DROPOUTS = (0.0, DROPOUT)


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
