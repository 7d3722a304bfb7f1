"""One rank of `gpu_check.py`'s `DistributedPipe` jobs (torchrun starts it).

    torchrun --standalone --nproc-per-node N bench/gpu_check_worker.py --out DIR [--raw]

On each rank's device (a GPU over NCCL, or the CPU over gloo), for every schedule: one
step of `dist_worker.tiny_lm` (tests/), this rank's gradients against the same model's
unpipelined step on the same device; with dropout, on two stages per rank, the gradients
saved (``DIR/dropout-rank{r}.pt``, for `gpu_check` to hold against the threaded `Pipe`'s,
whose stage threads must draw the same masks); `clip_grad_norm_` against PyTorch's on
the whole model; then two steady-state steps of an `mlp` under
``torch.cuda.set_sync_debug_mode("error")`` (on the CPU: `host_sync.HostSyncs`, whose
sites must not depend on the number of micro-batches). Each rank writes
``DIR/rank{r}.json``.

``--raw`` joins the process group without `job.process_group`, which refuses ranks that
share a GPU: it is how `gpu_check` tries NCCL with two ranks on one GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent)]
from dist_worker import MICROBATCHES, batch, tiny_lm, token_loss  # noqa: E402
from host_sync import HostSyncs  # noqa: E402

from pipeline_lib.distributed import DistributedPipe, init_mesh  # noqa: E402
from pipeline_lib.distributed.job import process_group  # noqa: E402
from pipeline_lib.grad_clip import clip_grad_norm_  # noqa: E402
from pipeline_lib.schedules import BUILDERS, stages_per_rank  # noqa: E402

LAYERS, DROPOUT, CLIP = 8, 0.2, 0.05
DROPOUT_SCHEDULE = "interleaved_1f1b"   # two stages per rank: two threads in Pipe
SEED = 5                                # rank 0's generator before the step: the step seed
TOLERANCE = dict(rtol=1e-4, atol=1e-5)   # GPU kernels sum in another order


def even(layers: int, stages: int) -> list[int]:
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def reference(device: torch.device, clip: float | None = None
              ) -> tuple[float | None, dict[str, torch.Tensor]]:
    """The unpipelined model's gradients, by name, on ``device``, clipped to ``clip``
    (with the norm before clipping)."""
    model = tiny_lm().to(device)
    inputs, target = (t.to(device) for t in batch())
    token_loss(model(inputs), target).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None
    return norm, {name: p.grad for name, p in model.named_parameters()}


def step(schedule: str, mesh: Any, dropout: float = 0.0,
         microbatches: int = MICROBATCHES) -> tuple[DistributedPipe, dict[str, torch.Tensor]]:
    """One step of ``schedule``; the pipe and this rank's gradients by the model's names."""
    model = tiny_lm(dropout)
    names = {id(p): n for n, p in model.named_parameters()}
    stages = mesh.pp * stages_per_rank(schedule)
    pipe = DistributedPipe(model, mesh, even(LAYERS, stages), microbatches, schedule)
    torch.manual_seed(SEED)
    pipe.step(*batch(), token_loss)
    return pipe, {names[id(p)]: p.grad for p in pipe.parameters()}


def largest_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    """None if every gradient is within `TOLERANCE` of its reference, else which is not."""
    for name, grad in got.items():
        try:
            torch.testing.assert_close(grad, want[name], **TOLERANCE)
        except AssertionError as exc:
            return f"{name}: {str(exc).splitlines()[-2].strip()}"
    return None


def mlp(dropout: float = 0.1) -> nn.Sequential:
    """Linear layers with dropout, for the checks of host waits: an embedding's backward
    reads a count to the host inside PyTorch on some versions, which would hide ours."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(dropout), nn.Tanh())
                           for _ in range(3)], nn.Linear(16, 5))


def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(10, 16, generator=g), torch.randint(0, 5, (10,), generator=g)


def sync_check(mesh: Any) -> dict[str, Any]:
    """Two steady-state steps with nothing that makes the host wait per micro-batch."""
    pipes = {m: DistributedPipe(mlp(), mesh, even(4, mesh.pp), m, "1f1b") for m in (2, 4)}
    for pipe in pipes.values():
        pipe.step(*mlp_batch(), F.cross_entropy)
    if mesh.device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                pipes[4].step(*mlp_batch(), F.cross_entropy)
        except RuntimeError as exc:
            return {"ok": False, "detail": f"{exc}".splitlines()[0][:300] + " at " +
                    "".join(traceback.format_tb(exc.__traceback__, -3)).replace("\n", " ")[-400:]}
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return {"ok": True, "detail": "no synchronising call in 2 steady-state steps"}
    sites = {}
    for m, pipe in pipes.items():
        with HostSyncs() as syncs:
            pipe.step(*mlp_batch(), F.cross_entropy)
        sites[m] = syncs.by_site()
    growing = sorted(site for site in sites[4] if sites[4][site] != sites[2].get(site))
    return {"ok": not growing, "detail": f"per micro-batch or message: {growing}" if growing
            else f"host syncs per step, at m = 2 and 4: {sites[4]}"}


@contextlib.contextmanager
def joined(raw: bool, backend: str) -> Iterator[None]:
    """The process group: `job.process_group`'s, or, ``raw``, one that lets ranks share
    a GPU (where NCCL allows it)."""
    if not raw:
        with process_group(None if backend == "default" else backend, timeout=120):
            yield
        return
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--raw", action="store_true")
    parser.add_argument("--backend", default="default")
    parser.add_argument("--schedules", default=",".join(sorted(BUILDERS)))
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"schedules": {}}
    out = args.out / f"rank{rank}.json"
    try:
        with joined(args.raw, args.backend):
            mesh = init_mesh(dist.get_world_size(), timeout=120)
            result.update(backend=dist.get_backend(), device=str(mesh.device))
            want = reference(mesh.device)[1]
            for schedule in args.schedules.split(","):
                result["schedules"][schedule] = largest_error(step(schedule, mesh)[1], want)
            grads = step(DROPOUT_SCHEDULE, mesh, DROPOUT)[1]
            torch.save({n: g.cpu() for n, g in grads.items()}, args.out / f"dropout-rank{rank}.pt")
            pipe, grads = step("1f1b", mesh)   # clipped in place below
            norm = clip_grad_norm_(pipe, CLIP).item()
            expected, clipped = reference(mesh.device, CLIP)
            result["clip"] = largest_error(grads, clipped) if math.isclose(
                norm, expected, rel_tol=1e-4) else f"norm {norm}, expected {expected}"
            result["sync"] = sync_check(mesh)
    except Exception as exc:  # noqa: BLE001 - the parent reads why
        result["error"] = f"{type(exc).__name__}: {exc}"
        out.write_text(json.dumps(result))
        raise
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
