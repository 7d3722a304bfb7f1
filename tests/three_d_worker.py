"""The 8 gloo processes of `test_three_d.py`: `DistributedPipe` on ``tp × pp × dp``
meshes, every case in one launch, each rank saving what it computed to
``OUT/rank{r}.pt``; the test compares it with one process.

First the training program, ``lm.train --tp 2 --pp 2 --dp 2 --fsdp --sequence-parallel``
(`TRAIN_ARGS`, the model `tiny_lm`'s as a preset), one clipped AdamW step saved as a
checkpoint in ``OUT/checkpoint``. Then the `CASES`, mesh by mesh (``init_mesh(pp, dp,
order=..., tp=...)``): 2 × 2 × 2 in Megatron-LM's order ("tp-dp-pp"), a schedule of each
family (1F1B, interleaved 1F1B, ZB-V), the replicas as DDP (`replicate` under tensor
parallelism) or FSDP (resharded after forward or not), with and without sequence
parallelism, recompute and dropout. Each runs one step on one batch and saves its loss
and gradients, whole, by the names of ``shardable(tiny_lm())``; cases with ``traffic``
run a step before (it agrees the messages' layouts) and save the counted step's
messages per mesh dimension (`parallel.traffic.Traffic`); the case with ``clip`` clips
the gradient norm over the three dimensions and saves the norm and the clipped
gradients. The "resume" cases, on 4 × 2 × 1 and 1 × 4 × 2 in Llama 3's order
("tp-pp-dp"), resume the training program's checkpoint, run the second batch's step,
clip and update, and save the loss, the gradients, the norm and the weights after.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline_lib import run_state
from pipeline_lib.distributed import DistributedPipe, init_mesh, process_group
from pipeline_lib.distributed.mesh import Mesh
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.lm import train
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import PRESETS, transformer_lm
from pipeline_lib.parallel.block import shardable, unpack_projections
from pipeline_lib.parallel.traffic import Traffic
from pipeline_lib.schedules import stages_per_rank

VOCAB, ROWS, SEQ, LAYERS = 64, 8, 8, 4   # embedding, 2 blocks, decoder
MODEL = dict(d_model=16, nhead=4, d_hid=32, nlayers=LAYERS - 2)
LR, CLIP, DROPOUT = 0.01, 0.05, 0.1
MEGATRON, LLAMA3 = "tp-dp-pp", "tp-pp-dp"
PRESET = "three-d"   # lm.train's model: tiny_lm's
TRAIN_ARGS = ["--tp", "2", "--pp", "2", "--dp", "2", "--fsdp", "--sequence-parallel",
              "--microbatches", "2", "--batch", str(ROWS), "--bptt", str(SEQ),
              "--synthetic", str(VOCAB), "--preset", PRESET, "--balance", "params",
              "--steps", "1", "--lr", str(LR), "--warmup", "0", "--lr-floor", "1",
              "--clip", str(CLIP), "--eval-steps", "1", "--log-every", "1", "--seed", "0",
              "--timeout", "120"]


@dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple[int, int, int, str]     # tp, pp, dp, rank order
    schedule: str
    data: str = "ddp"                   # "ddp" (replicate under tp), "fsdp", "fsdp-keep"
    sequence_parallel: bool = False
    checkpoint: str = "never"
    microbatches: int = 2
    traffic: bool = False               # two steps, the second's messages counted
    clip: bool = False                  # the gradient norm clipped after the step
    dropout: float = 0.0
    resume: bool = False                # resume lm.train's checkpoint, train one step

    @property
    def balance(self) -> list[int]:
        stages = self.mesh[1] * stages_per_rank(self.schedule)
        return [LAYERS // stages] * stages


CUBE = (2, 2, 2, MEGATRON)
CASES = [
    Case("1f1b fsdp sp", CUBE, "1f1b", "fsdp", True, traffic=True, clip=True),
    Case("interleaved", CUBE, "interleaved_1f1b", microbatches=4),
    Case("zb_v fsdp-keep sp recompute", CUBE, "zb_v", "fsdp-keep", True, "always"),
    Case("dropout", CUBE, "1f1b", "fsdp", True, dropout=DROPOUT),
    Case("dropout recompute", CUBE, "1f1b", "fsdp", True, "always", dropout=DROPOUT),
    Case("resume tp 4", (4, 2, 1, LLAMA3), "1f1b", sequence_parallel=True, resume=True),
    Case("resume pp 4 fsdp", (1, 4, 2, LLAMA3), "1f1b", "fsdp", resume=True),
]


def tiny_lm(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return transformer_lm(VOCAB, **MODEL, dropout=dropout)


def batch(k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + k)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def whole(t: torch.Tensor) -> torch.Tensor:
    """As one process holds it, a copy (a DTensor gathered: every rank holding a part
    calls it): clipping later scales the gradients in place."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone()


def named(pipe: DistributedPipe, balance: list[int], what: str) -> dict[str, torch.Tensor]:
    """This rank's stages' gradients (``what="grad"``) or weights, whole, by the names of
    ``shardable(tiny_lm())`` (a stage that tp = 1 leaves as it is has its attention's
    projections packed: split here)."""
    starts = list(itertools.accumulate(balance, initial=0))
    found = {}
    for s, module in pipe.modules.items():
        for name, p in getattr(module, "module", module).named_parameters():
            layer, rest = name.split(".", 1)
            value = p.grad if what == "grad" else p
            if value is None:
                raise RuntimeError(f"{name} of stage {s} has no gradient")
            found[f"{starts[s] + int(layer)}.{rest}"] = whole(value)
    return unpack_projections(found, lambda t: list(t.chunk(3)))


def build(case: Case, mesh: Mesh) -> DistributedPipe:
    return DistributedPipe(tiny_lm(case.dropout), mesh, case.balance, case.microbatches,
                           case.schedule, case.checkpoint,
                           sequence_parallel=case.sequence_parallel,
                           shard_parameters=case.data != "ddp",
                           reshard_after_forward=case.data != "fsdp-keep")


def traffic_of(mesh: Mesh) -> Traffic:
    return Traffic({"tp": mesh.tp_group, "dp": mesh.dp_group,
                    "pp": list(mesh.channels.values())})


def run_case(case: Case, mesh: Mesh, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    pipe = build(case, mesh)
    if case.resume:
        return resume_case(case, pipe, out) | {"seconds": time.perf_counter() - start}
    inputs, target = batch()
    if case.traffic:   # the messages' layouts agreed: a steady step next
        pipe.step(inputs, target, lm_loss)
        for p in pipe.parameters():
            p.grad = None
    traffic = traffic_of(mesh)
    with traffic if case.traffic else contextlib.nullcontext():
        loss = pipe.step(inputs, target, lm_loss)
    record = dict(loss=None if loss is None else loss.item(),
                  grads=named(pipe, case.balance, "grad"))
    if case.traffic:
        record["sent"] = traffic.sent()
    if case.clip:
        record["norm"] = clip_grad_norm_(pipe, CLIP).item()
        record["clipped"] = named(pipe, case.balance, "grad")
    return record | {"seconds": time.perf_counter() - start}


def train_program(out: Path) -> float:
    """``lm.train`` with `TRAIN_ARGS` in this job's process group, saving into
    ``out/checkpoint``; its seconds."""
    start = time.perf_counter()
    PRESETS[PRESET] = {**MODEL, "dropout": 0.0}
    joined, train.process_group = train.process_group, lambda timeout: contextlib.nullcontext()
    try:
        train.main(TRAIN_ARGS + ["--save", str(out / "checkpoint")])
    finally:
        train.process_group = joined
    return time.perf_counter() - start


def resume_case(case: Case, pipe: DistributedPipe, out: Path) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    done = run_state.resume(out / "checkpoint", pipe, case.balance, optimizer)
    loss = pipe.step(*batch(1), lm_loss)
    grads = named(pipe, case.balance, "grad")
    norm = clip_grad_norm_(pipe, CLIP).item()
    optimizer.step()
    return dict(done=done, loss=None if loss is None else loss.item(), grads=grads,
                norm=norm, weights=named(pipe, case.balance, "weight"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=None,
                        help="names, lm.train among them (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(timeout=120):
        records: dict[str, Any] = {}
        if args.cases is None or "lm.train" in args.cases:
            records["lm.train"] = {"seconds": train_program(args.out)}
        chosen = [c for c in CASES if args.cases is None or c.name in args.cases]
        for (tp, pp, dp, order), cases in itertools.groupby(chosen, key=lambda c: c.mesh):
            mesh = init_mesh(pp, dp, 60, order, tp=tp)
            for case in cases:
                try:
                    records[case.name] = run_case(case, mesh, args.out)
                except Exception as exc:
                    exc.add_note(f"in case {case.name!r}")
                    raise
                records[case.name]["place"] = (mesh.tp_rank, mesh.pipe_rank, mesh.replica)
        torch.save(records, args.out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
