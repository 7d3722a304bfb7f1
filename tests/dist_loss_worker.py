"""One rank of `test_distributed_loss.py`, launched by torchrun on gloo.

``--meshes 2x1 --out DIR`` (or ``2x2``): for each ``pp x dp`` mesh, runs one step of
each case below and saves, per rank, every case's loss and gradients (by the full
model's parameter names) in ``DIR/<mesh>-rank<r>.pt``:

* ``token-<schedule>``: a token model on padded batches, ``loss_fn`` returning
  ``(loss_sum, count)``; ``-recompute`` with every micro-batch checkpointed;
* ``tree-<schedule>``: stages that pass dicts holding lists, tuples, integer tensors,
  None and a float, with a mean loss;
* ``accumulate``: like ``token-1f1b``, with gradients already in ``.grad``, which must
  stay as they were (not divided by the token count).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed import init_mesh, process_group
from workloads import padded_batch, token_model, token_sum, tree_batch, tree_model

MICROBATCHES, EARLIER = 4, 0.25
CASES = {"2x1": ["token-gpipe", "token-1f1b", "token-interleaved_1f1b", "token-zb_h1",
                 "token-1f1b-recompute", "tree-1f1b", "tree-zb_h1", "accumulate"],
         "2x2": ["token-1f1b", "token-zb_h1", "accumulate"]}


def run(mesh_name: str, out: Path) -> None:
    pp, dp = (int(n) for n in mesh_name.split("x"))
    mesh = init_mesh(pp, dp, timeout=60)
    saved = {}
    for case in CASES[mesh_name]:
        kind, _, rest = case.partition("-")
        schedule = rest.removesuffix("-recompute") or "1f1b"
        model = tree_model() if kind == "tree" else token_model()
        names = {id(p): n for n, p in model.named_parameters()}
        stages = 2 * pp if schedule == "interleaved_1f1b" else pp
        balance = [len(model) // stages] * stages
        checkpoint = "always" if case.endswith("-recompute") else "never"
        pipe = DistributedPipe(model, mesh, balance, MICROBATCHES, schedule, checkpoint)
        params = list(pipe.parameters())
        for p in params:
            p.grad = torch.full_like(p, EARLIER) if kind == "accumulate" else None
        if kind == "tree":
            loss = pipe.step(*tree_batch(), F.cross_entropy)
        else:
            loss = pipe.step(*padded_batch(), token_sum)
        saved[case] = {"loss": None if loss is None else loss.item(),
                       "grads": {names[id(p)]: p.grad.clone() for p in params}}
    torch.save(saved, out / f"{mesh_name}-rank{mesh.rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", choices=sorted(CASES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(backend="gloo", timeout=60):
        run(args.mesh, args.out)


if __name__ == "__main__":
    main()
