"""The 8 gloo processes of `test_three_d.py`: `DistributedPipe` on ``tp × pp × dp``
meshes, every case in one launch, each rank saving what it computed to
``OUT/rank{r}.pt``; the test compares it with one process.

Meshes, in order (``init_mesh(pp, dp, order=..., tp=...)``): 2 × 2 × 2 in Megatron-LM's
order ("tp-dp-pp") and in Llama 3's ("tp-pp-dp"), then 2 × 4 × 1, 4 × 2 × 1 and
1 × 2 × 4. On each, the `CASES` whose ``mesh`` it is: a schedule of each family, the
replicas as DDP (`replicate` under tensor parallelism) or FSDP (resharded after forward
or not), with and without sequence parallelism and recompute. Each case runs two steps
on one batch (the first agrees the messages' layouts) and saves the second's loss and
gradients, whole, by the names of ``shardable(tiny_lm())``; cases with ``traffic`` also
save its messages per mesh dimension (`parallel.traffic.Traffic`).

Training across layouts: case "train" (2 × 2 × 2) takes a clipped AdamW step and saves a
checkpoint (`run_state`); the "resume" cases of the later meshes (another tp, pp, dp,
FSDP) resume from it, run the second batch's step, clip and update, and save the loss,
the gradient norm and the weights after the update.
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
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.parallel.block import shardable
from pipeline_lib.parallel.traffic import Traffic
from pipeline_lib.schedules import stages_per_rank

VOCAB, ROWS, SEQ, LAYERS = 64, 8, 8, 4   # embedding, 2 blocks, decoder
MODEL = dict(d_model=16, nhead=4, d_hid=32, nlayers=LAYERS - 2)
LR, CLIP, DROPOUT = 0.01, 0.05, 0.1
MEGATRON, LLAMA3 = "tp-dp-pp", "tp-pp-dp"


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
    dropout: float = 0.0
    resume: bool = False                # resume "train"'s checkpoint, train one step

    @property
    def balance(self) -> list[int]:
        stages = self.mesh[1] * stages_per_rank(self.schedule)
        return [LAYERS // stages] * stages


CUBE, CUBE_LLAMA = (2, 2, 2, MEGATRON), (2, 2, 2, LLAMA3)
CASES = [
    Case("gpipe", CUBE, "gpipe"),
    Case("1f1b fsdp sp", CUBE, "1f1b", "fsdp", True, microbatches=4, traffic=True),
    Case("1f1b fsdp-keep recompute", CUBE, "1f1b", "fsdp-keep", checkpoint="always"),
    Case("1f1b", CUBE, "1f1b", microbatches=4, traffic=True),
    Case("interleaved sp recompute", CUBE, "interleaved_1f1b", "ddp", True, "except_last"),
    Case("zb_h1 fsdp", CUBE, "zb_h1", "fsdp", microbatches=4, traffic=True),
    Case("zb_v fsdp-keep sp recompute", CUBE, "zb_v", "fsdp-keep", True, "always"),
    Case("dualpipe_v", CUBE, "dualpipe_v", microbatches=4),
    Case("dropout", CUBE, "1f1b", "fsdp", True, dropout=DROPOUT),
    Case("dropout recompute", CUBE, "1f1b", "fsdp", True, "always", dropout=DROPOUT),
    Case("train", CUBE, "1f1b", "fsdp", True),
    Case("interleaved fsdp", CUBE_LLAMA, "interleaved_1f1b", "fsdp", microbatches=4,
         traffic=True),
    Case("1f1b sp", CUBE_LLAMA, "1f1b", "ddp", True, microbatches=4, traffic=True),
    Case("resume pp 4", (2, 4, 1, LLAMA3), "1f1b", resume=True),
    Case("resume tp 4", (4, 2, 1, LLAMA3), "1f1b", sequence_parallel=True, resume=True),
    Case("resume tp 1 fsdp", (1, 2, 4, LLAMA3), "1f1b", "fsdp", resume=True),
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
    ``shardable(tiny_lm())``."""
    starts = list(itertools.accumulate(balance, initial=0))
    found = {}
    for s, module in pipe.modules.items():
        for name, p in getattr(module, "module", module).named_parameters():
            layer, rest = name.split(".", 1)
            value = p.grad if what == "grad" else p
            if value is None:
                raise RuntimeError(f"{name} of stage {s} has no gradient")
            found[f"{starts[s] + int(layer)}.{rest}"] = whole(value)
    return found


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
        record["messages"] = [(m.dim, m.kind, m.size, m.ranks) for m in traffic.messages]
    if case.name == "train":
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        record["norm"] = clip_grad_norm_(pipe, CLIP).item()
        optimizer.step()
        run_state.save(out / "checkpoint", 1, pipe, case.balance, optimizer)
    return record | {"seconds": time.perf_counter() - start}


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
    parser.add_argument("--cases", nargs="*", default=None, help="names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(timeout=120):
        records: dict[str, Any] = {}
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
