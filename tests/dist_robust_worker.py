"""One rank of `test_distributed_robust.py`: inputs that `DistributedPipe` must either train
exactly or refuse on every rank, launched by torchrun on gloo.

``--scenario accepted --out DIR`` (4 processes) runs, on a mesh of 2 ranks × 2 replicas
and then on 4 ranks, each case of `ACCEPTED` and saves per rank, in
``DIR/accepted-rank<r>.pt``, what each computed (loss, gradients by the full model's
parameter names, parameters after an SGD step) or the message of the error it raised:

* ``tied``: the embedding and the output layer share their weight, under ZB-V, which holds
  the first and the last stage on rank 0; gradients were already in ``.grad``;
* ``tied-across``, ``storage-across``: the same weight (or two parameters sharing one
  storage) on stages of different ranks, which must be refused;
* ``nochunk``: a mask wrapped in `NoChunk` that every micro-batch must get whole;
* ``frozen``: a parameter the forward never uses, frozen, with replicas;
* ``rows``: rank 3 is given a batch of other shapes; ``steps``: rank 3 is one step behind.

The other scenarios fail and end the job; each rank saves, before it raises, its error and
whether ``.grad`` is as it was before the step: ``unused`` (4 processes: a parameter the
forward never uses, with replicas) and ``raise`` (2 processes: rank 1 raises in the middle
of the second step, after both ranks have accumulated gradients).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dist_worker import Hiccup, boom
from pipeline_lib import NoChunk
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import Mesh, init_mesh

VOCAB, D, ROWS, SEQ, MICROBATCHES, LR, EARLIER = 13, 8, 10, 6, 4, 0.1, 0.25
ACCEPTED = {"2x2": ["tied", "tied-across", "storage-across", "nochunk", "frozen", "rows",
                    "steps"],
            "4x1": ["tied", "nochunk"]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class MaskedEmbedding(nn.Module):
    """Embeds ``{"ids": [rows, seq], "mask": [seq]}``, zeroing masked positions: the mask
    has no batch dimension, so it travels in `NoChunk`."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embedding(batch["ids"]) * batch["mask"][None, :, None]


class Spare(Block):
    """A block with a parameter that its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Parameter(torch.ones(3))


def tied_lm(layers: int, share: str = "parameter") -> nn.Sequential:
    """Embedding, blocks, output layer: ``layers`` in all, the output layer's weight the
    embedding's (``share="storage"``: another parameter on the same storage)."""
    torch.manual_seed(0)
    embedding, output = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
    output.weight = (embedding.weight if share == "parameter"
                     else nn.Parameter(embedding.weight.detach()))
    return nn.Sequential(embedding, *(Block() for _ in range(layers - 2)), output)


def masked_lm(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MaskedEmbedding(), *(Block() for _ in range(layers - 2)),
                         nn.Linear(D, VOCAB))


def spare_lm(frozen: bool) -> nn.Sequential:
    """Stage 0 (of 2) holds a parameter that the forward never uses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, D), Spare(), Block(), nn.Linear(D, VOCAB))
    model[1].spare.requires_grad_(not frozen)
    return model


def batch(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def mask() -> torch.Tensor:
    return torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def case_setup(case: str, pp: int) -> tuple[nn.Sequential, str, list[int], Any]:
    """(model, schedule, balance, inputs) of a case on ``pp`` ranks."""
    ids, _ = batch()
    if case == "tied":   # a V: 2·pp stages of one layer, the first and the last on rank 0
        return tied_lm(2 * pp), "zb_v", [1] * (2 * pp), ids
    if case in ("tied-across", "storage-across"):
        model = tied_lm(4, "parameter" if case == "tied-across" else "storage")
        return model, "1f1b", [2, 2], ids
    if case == "nochunk":
        layers = 4 if pp == 2 else pp
        return masked_lm(layers), "1f1b", [layers // pp] * pp, \
            {"ids": ids, "mask": NoChunk(mask())}
    return spare_lm(frozen=True), "1f1b", [2, 2], ids   # frozen, rows, steps


def run_case(case: str, mesh: Mesh) -> dict[str, Any]:
    model, schedule, balance, inputs = case_setup(case, mesh.pp)
    names = {id(p): n for n, p in model.named_parameters()}
    _, target = batch()
    try:
        pipe = DistributedPipe(model, mesh, balance, MICROBATCHES, schedule)
        params = list(pipe.parameters())
        for p in params:
            p.grad = torch.full_like(p, EARLIER) if case == "tied" else None
        if case == "rows" and mesh.rank == 3:
            inputs, target = batch(ROWS + 2)
        if case == "steps":   # rank 3 steps a second pipe while the others step the first
            other = DistributedPipe(spare_lm(frozen=True), mesh, balance, MICROBATCHES)
            pipe.step(inputs, target, token_loss)
            pipe = other if mesh.rank == 3 else pipe
        loss = pipe.step(inputs, target, token_loss)
    except ValueError as exc:
        return {"error": str(exc)}
    grads = {names[id(p)]: p.grad.clone() for p in params if p.grad is not None}
    torch.optim.SGD(params, lr=LR).step()
    return {"loss": None if loss is None else loss.item(), "grads": grads,
            "params": {names[id(p)]: p.detach().clone() for p in params}}


def run_accepted(out: Path) -> None:
    saved = {}
    for mesh_name, cases in ACCEPTED.items():
        pp, dp = (int(n) for n in mesh_name.split("x"))
        mesh = init_mesh(pp, dp, timeout=60)
        for case in cases:
            saved[f"{mesh_name}-{case}"] = run_case(case, mesh)
    torch.save(saved, out / f"accepted-rank{os.environ['RANK']}.pt")


def run_failing(scenario: str, out: Path) -> None:
    """Save this rank's error and whether ``.grad`` is as before the step, then raise."""
    if scenario == "unused":
        mesh, model = init_mesh(2, 2, timeout=60), spare_lm(frozen=False)
    else:   # rank 1 raises at its third forward of the second step, whose messages
        # travel into receives posted early: after the backwards of micro-batches 0 and 1
        mesh = init_mesh(2, timeout=60)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), Hiccup(MICROBATCHES + 3, boom),
                              nn.Linear(6, 3))
    pipe = DistributedPipe(model, mesh, [2, 2], MICROBATCHES, "1f1b")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    inputs, target = batch() if scenario == "unused" else (torch.randn(ROWS, 6),
                                                           torch.randn(ROWS, 3))
    loss_fn: Callable[[Any, Any], Any] = token_loss if scenario == "unused" else F.mse_loss
    for p in pipe.parameters():
        p.grad = torch.full_like(p, EARLIER)
    for step in range(2):
        before = {id(p): p.grad.clone() for p in pipe.parameters()}
        try:
            pipe.step(inputs, target, loss_fn)
        except Exception as exc:
            same = all(torch.equal(p.grad, before[id(p)]) for p in pipe.parameters())
            torch.save({"step": step, "error": f"{type(exc).__name__}: {exc}",
                        "grads_as_before": same}, out / f"{scenario}-rank{mesh.rank}.pt")
            raise
        optimizer.step()
        print(f"rank {mesh.rank}: optimizer step {step} taken", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=["accepted", "unused", "raise"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(backend="gloo", timeout=60):
        if args.scenario == "accepted":
            run_accepted(args.out)
        else:
            run_failing(args.scenario, args.out)


if __name__ == "__main__":
    main()
