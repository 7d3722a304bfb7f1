"""One rank of the multi-process tests; `test_distributed.py` launches it with torchrun.

``--scenario schedules --meshes 4x1,2x2 --out DIR``: for each ``pp x dp`` mesh, every
schedule (and 1F1B recomputing every micro-batch, and with dropout; interleaved 1F1B on
the plain transport, `post_early=False`) on a tiny Transformer LM, saving each rank's
loss, gradients (by the full model's parameter names) and parameters after one SGD step,
and rank 0's timeline. Each runs two steps on one batch and saves the second: its
messages travel into receives posted early (except on the plain transport).
``shapes`` trains on batches whose sequence length changes, saving every step's loss.
The other scenarios fail, to check that every rank stops and the output says why: in
``raise``, rank 1 raises while rank 0 is in the middle of a 2-minute forward; in
``killed``, rank 1's process is killed while rank 0 waits for its message; ``mismatch``
and ``reshape`` send what the receiver cannot use; ``mesh_args`` gives the ranks
different `init_mesh` arguments, and in ``steps`` rank 1 runs one step fewer.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import init_mesh
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.schedules import Action, Schedule

VOCAB, ROWS, SEQ, MICROBATCHES, LR, DROPOUT = 50, 10, 6, 4, 0.1, 0.2
SLEEP = 120   # seconds: far longer than the test lets a failed run take
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "reordered", "1f1b-recompute",
             "1f1b-dropout", "interleaved_1f1b-plain"]
ONLY_ON = {"reordered": "2x1", "1f1b-dropout": "x1"}   # meshes (suffixes) they run on


def tiny_lm(dropout: float = 0.0) -> nn.Sequential:
    """8 layers: embedding, 6 blocks, decoder, so 8 stages fit on 4 ranks × 2."""
    torch.manual_seed(0)
    return transformer_lm(VOCAB, d_model=16, nhead=2, d_hid=32, nlayers=6, dropout=dropout)


def runs_on(mesh: str, name: str) -> bool:
    return mesh.endswith(ONLY_ON.get(name, ""))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """10 rows: uneven micro-batches (3, 3, 2, 2) exercise the loss weights."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
            torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def reordered(m: int) -> Schedule:
    """GPipe on 2 ranks, but rank 0 runs its backwards last micro-batch first while rank 1
    sends their gradients first micro-batch first: rank 0 must buffer early arrivals."""
    return Schedule("reordered", 2, m, [
        [Action(0, "F", i) for i in range(m)] + [Action(0, "B", i) for i in reversed(range(m))],
        [Action(1, "F", i) for i in range(m)] + [Action(1, "B", i) for i in range(m)]])


def run_schedules(meshes: list[tuple[int, int]], out: Path) -> None:
    inputs, target = batch()
    for pp, dp in meshes:
        mesh = init_mesh(pp, dp, timeout=60)
        for name in SCHEDULES:
            if not runs_on(f"{pp}x{dp}", name):
                continue
            model = tiny_lm(DROPOUT if name == "1f1b-dropout" else 0.0)
            names = {id(p): n for n, p in model.named_parameters()}
            stages = 2 * pp if name.startswith("interleaved_1f1b") else pp
            balance = [len(model) // stages] * stages
            schedule = reordered(MICROBATCHES) if name == "reordered" else name.split("-")[0]
            checkpoint = "always" if name == "1f1b-recompute" else "never"
            pipe = DistributedPipe(model, mesh, balance, MICROBATCHES, schedule, checkpoint,
                                   post_early=not name.endswith("plain"))
            params = list(pipe.parameters())
            for _ in range(2):
                for p in params:
                    p.grad = None
                loss = pipe.step(inputs, target, token_loss)
            grads = {names[id(p)]: p.grad.clone() for p in params}
            torch.optim.SGD(params, lr=LR).step()
            tag = f"{pp}x{dp}-{name}"
            torch.save({"loss": None if loss is None else loss.item(), "grads": grads,
                        "params": {names[id(p)]: p.detach().clone() for p in params}},
                       out / f"{tag}-rank{mesh.rank}.pt")
            timeline = pipe.gather_timeline()
            if timeline is not None:
                record = {"timeline": timeline.to_dict(),
                          "programs": [[str(a) for a in p] for p in pipe.schedule.actions]}
                (out / f"{tag}-timeline.json").write_text(json.dumps(record))


class Hiccup(nn.Module):
    """Passes its input through, and calls ``event`` on its ``call``-th forward."""

    def __init__(self, call: int, event: Callable[[], None]) -> None:
        super().__init__()
        self.call, self.event, self.calls = call, event, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.call:
            self.event()
        return x


SEQ_LENGTHS = [SEQ, SEQ, SEQ + 3, SEQ + 3, SEQ]   # a new shape, then back


def run_shapes(out: Path) -> None:
    mesh = init_mesh(2, timeout=60)
    pipe = DistributedPipe(tiny_lm(), mesh, [4, 4], MICROBATCHES, "1f1b")
    inputs, target = batch()
    losses = []
    for length in SEQ_LENGTHS:
        for p in pipe.parameters():
            p.grad = None
        loss = pipe.step(inputs[:, :length], target[:, :length], token_loss)
        losses.append(None if loss is None else loss.item())
    torch.save({"losses": losses}, out / f"shapes-rank{mesh.rank}.pt")


class Narrowing(nn.Module):
    """Keeps the first 4 features from its 5th call on (the second step's first micro-batch):
    an output shape that changes while the batch's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x[:, :4] if self.calls >= 5 else x


class SumFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True)


def boom() -> None:
    raise RuntimeError("boom: injected failure")


def killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_failing(scenario: str, timeout: float) -> None:
    rank = int(os.environ["RANK"])
    if scenario == "mesh_args":
        init_mesh(*((2, 1) if rank == 0 else (1, 2)), timeout=timeout)
    mesh = init_mesh(2, timeout=timeout)
    torch.manual_seed(0)
    steps = 2
    if scenario == "raise":   # rank 1 fails while rank 0 is busy in a long forward
        model = nn.Sequential(nn.Linear(8, 8), Hiccup(3, lambda: time.sleep(SLEEP)),
                              nn.Linear(8, 4), Hiccup(2, boom))
        balance = [2, 2]
    elif scenario == "killed":   # rank 1 dies at its last forward; rank 0 waits for it
        model = nn.Sequential(nn.Linear(8, 4), Hiccup(MICROBATCHES, killed))
        balance = [1, 1]
    elif scenario == "steps":
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
        balance, steps = [1, 1], 3 - rank
    elif scenario == "mismatch":  # stage 0 produces 16 features, stage 1 expects 12
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(12, 4))
        balance = [1, 1]
    else:   # reshape: stage 0's output narrows in the second step
        model = nn.Sequential(nn.Linear(8, 8), Narrowing(), SumFeatures())
        balance = [2, 1]
    pipe = DistributedPipe(model, mesh, balance, MICROBATCHES, "gpipe")
    for step in range(steps):
        g = torch.Generator().manual_seed(step)   # the same batch on every rank
        pipe.step(torch.randn(8, 8, generator=g),
                  torch.randn(8, 1 if scenario == "reshape" else 4, generator=g), F.mse_loss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=["schedules", "shapes", "raise", "killed",
                                               "mismatch", "reshape", "mesh_args", "steps"])
    parser.add_argument("--meshes", default="2x1", help="pp x dp meshes, comma-separated")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(backend="gloo", timeout=args.timeout):
        if args.scenario == "schedules":
            meshes = [tuple(int(n) for n in m.split("x")) for m in args.meshes.split(",")]
            run_schedules(meshes, args.out)
        elif args.scenario == "shapes":
            run_shapes(args.out)
        else:
            run_failing(args.scenario, args.timeout)


if __name__ == "__main__":
    main()
