"""One rank of `test_frontier_schedules.py`'s multi-process runs; launched by torchrun.

``--meshes 2x1 --out DIR``: for each ``pp x dp`` mesh and each of its `cases` (schedule,
checkpoint mode, micro-batches, workload), trains two steps on one batch and saves each
rank's loss and gradients, by the full model's parameter names, of the second step. The
workloads: "lm", `dist_worker.tiny_lm` on 10 rows (uneven micro-batches); "tokens",
`workloads.token_model` on padded rows with a (loss_sum, count) loss, whose micro-batches
and replicas hold different numbers of real tokens.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import dist_worker as base   # the tiny LM, its batch and loss, shared with test_distributed
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import init_mesh
from pipeline_lib.schedules import stages_per_rank
from workloads import padded_batch, token_model, token_sum

CHECKPOINTS = ["always", "except_last", "never"]
FRONTIER = ["zb_h2", "zb_v", "dualpipe_v", "interleaved_zero_bubble", "looped_bfs",
            "interleaved_1f1b"]


def cases(mesh: str) -> list[tuple[str, str, int, str]]:
    """(schedule, checkpoint, micro-batches, workload): every schedule in every checkpoint
    mode on 2 ranks, with 3 micro-batches for interleaved 1F1B (not a multiple of the
    ranks); on 4 ranks, and 2 replicas of 2, the V-shaped ones; and these with token
    counts on 2 ranks and on 2 replicas of 2."""
    v_shaped = ("zb_v", "dualpipe_v")
    if mesh == "2x1":
        return [(name, checkpoint, 3 if name == "interleaved_1f1b" else base.MICROBATCHES,
                 "lm") for name in FRONTIER for checkpoint in CHECKPOINTS] + \
               [(name, "never", base.MICROBATCHES, "tokens") for name in v_shaped]
    tokens = [(name, "never", base.MICROBATCHES, "tokens") for name in v_shaped]
    return [(name, "except_last", base.MICROBATCHES, "lm") for name in v_shaped] + \
        (tokens if mesh == "2x2" else [])


def tag(mesh: str, name: str, checkpoint: str, chunks: int, workload: str) -> str:
    return f"{mesh}-{name}-{checkpoint}-m{chunks}-{workload}"


def run(meshes: list[str], out: Path) -> None:
    for mesh_name in meshes:
        pp, dp = (int(n) for n in mesh_name.split("x"))
        mesh = init_mesh(pp, dp, timeout=60)
        for name, checkpoint, chunks, workload in cases(mesh_name):
            if workload == "lm":
                model, (inputs, target), loss_fn = base.tiny_lm(), base.batch(), base.token_loss
            else:
                model, (inputs, target), loss_fn = token_model(), padded_batch(), token_sum
            names = {id(p): n for n, p in model.named_parameters()}
            stages = pp * stages_per_rank(name)
            pipe = DistributedPipe(model, mesh, [len(model) // stages] * stages, chunks, name,
                                   checkpoint)
            params = list(pipe.parameters())
            for _ in range(2):
                for p in params:
                    p.grad = None
                loss = pipe.step(inputs, target, loss_fn)
            torch.save({"loss": None if loss is None else loss.item(),
                        "grads": {names[id(p)]: p.grad.clone() for p in params}},
                       out / f"{tag(mesh_name, name, checkpoint, chunks, workload)}"
                             f"-rank{mesh.rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshes", default="2x1", help="pp x dp meshes, comma-separated")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(backend="gloo", timeout=60):
        run(args.meshes.split(","), args.out)


if __name__ == "__main__":
    main()
