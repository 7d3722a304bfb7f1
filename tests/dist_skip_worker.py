"""One rank of `test_skip_processes.py`, launched with torchrun on gloo.

``--scenarios skips,hostreads,autocast --out DIR`` runs these, in one launch:

``skips``: a model with skip connections (`skippable`) that cross
stages and ranks, neighbouring or not (and one stash of None), trained two steps under
each of `SCHEDULES`; each rank saves the second step's loss and gradients (by the model's
parameter names) and the rank pairs its channels join.
``hostreads``: the tensor reads on the host (``.item()``, ``.tolist()``, ``bool(t)``...)
each rank makes during a step whose batch has an earlier step's shapes, at two
micro-batch counts, each counted by the file of pipeline_lib that made it.
``autocast``: a step, then one with the same batch under autocast (bfloat16 messages);
then one with a mask given whole (`NoChunk`) after one where it was split.
``timeout``: rank 1 stalls in its second step's first forward for `STALL` seconds, longer
than the mesh's timeout, while rank 0 waits for its gradient.
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib import NoChunk, Namespace, pop, skippable, stash
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import init_mesh
from pipeline_lib.schedules import stages_per_rank
from dist_worker import Hiccup
from host_sync import HostSyncs
from workloads import PopMul, Stash

ROWS, WIDTH, MICROBATCHES, STALL = 12, 6, 4, 90.0
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_v", "zb_h1"]


@skippable(stash=["skip"])
class StashNone(nn.Module):
    def forward(self, x):
        yield stash("skip", None)
        return x


@skippable(pop=["skip"])
class PopNone(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        assert skip is None
        return x


def skip_model() -> nn.Sequential:
    """12 layers. ``outer`` goes from layer 0 to layer 11, ``inner`` from layer 1 to
    layer 7, ``nothing`` (None) from layer 2 to layer 9: on 2 or 3 ranks, each schedule
    below sends some of them to a neighbour, some past one, and keeps some on one rank
    (an interleaved rank's or a V's two stages)."""
    torch.manual_seed(0)
    outer, inner, nothing = Namespace("outer"), Namespace("inner"), Namespace("nothing")
    return nn.Sequential(Stash(WIDTH).isolate(outer), Stash(WIDTH).isolate(inner),
                         StashNone().isolate(nothing), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), PopMul(WIDTH).isolate(inner),
                         nn.Linear(WIDTH, WIDTH), PopNone().isolate(nothing), nn.Tanh(),
                         PopMul(WIDTH).isolate(outer))


def balance(name: str, pp: int) -> list[int]:
    stages = pp * stages_per_rank(name)
    layers = len(skip_model())
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def batch(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def run_skips(out: Path) -> None:
    pp = torch.distributed.get_world_size()
    mesh = init_mesh(pp, timeout=60)
    inputs, target = batch()
    for name in SCHEDULES:
        model = skip_model()
        names = {id(p): n for n, p in model.named_parameters()}
        pipe = DistributedPipe(model, mesh, balance(name, pp), MICROBATCHES, name)
        for _ in range(2):   # the second step's messages use the layouts agreed in the first
            for p in pipe.parameters():
                p.grad = None
            loss = pipe.step(inputs, target, F.mse_loss)
        torch.save({"loss": None if loss is None else loss.item(),
                    "grads": {names[id(p)]: p.grad for p in pipe.parameters()},
                    "pairs": pipe.lowered.pairs()},
                   out / f"skips-{name}-rank{mesh.rank}.pt")


def run_hostreads(out: Path) -> None:
    pp = torch.distributed.get_world_size()
    mesh = init_mesh(pp, timeout=60)
    inputs, target = batch(16)
    counted = {}
    for name in ("1f1b", "interleaved_1f1b"):
        for m in (2, 4):
            pipe = DistributedPipe(skip_model(), mesh, balance(name, pp), m, name)
            pipe.step(inputs, target, F.mse_loss)   # agrees the messages' layouts
            with HostSyncs() as syncs:
                pipe.step(inputs, target, F.mse_loss)
            # gloo's receives wait on the host by design (NCCL's only on the stream)
            counted[(name, m)] = dict(collections.Counter(
                call.site for call in syncs.calls if call.kind != "Work.wait"))
    torch.save(counted, out / f"hostreads-rank{mesh.rank}.pt")


class Carry(nn.Module):
    """A stage that passes a mask along beside its activation."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, inputs):
        x, mask = inputs
        return self.linear(x) * mask.float().mean(), mask


def run_autocast(out: Path) -> None:
    pp = torch.distributed.get_world_size()
    mesh = init_mesh(pp, timeout=60)
    inputs, target = batch()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(pp)))
    pipe = DistributedPipe(model, mesh, [1] * pp, MICROBATCHES, "1f1b")
    losses = [pipe.step(inputs, target, F.mse_loss)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses.append(pipe.step(inputs, target, F.mse_loss))
    torch.manual_seed(0)
    carried = nn.Sequential(*(Carry() for _ in range(pp - 1)), nn.Sequential(Carry(), Take()))
    pipe = DistributedPipe(carried, mesh, [1] * pp, MICROBATCHES, "1f1b")
    mask = torch.ones(ROWS, WIDTH, dtype=torch.bool)
    losses.append(pipe.step((inputs, mask), target, F.mse_loss))
    losses.append(pipe.step((inputs, NoChunk(mask)), target, F.mse_loss))
    torch.save([None if loss is None else loss.item() for loss in losses],
               out / f"autocast-rank{mesh.rank}.pt")


class Take(nn.Module):
    def forward(self, inputs):
        return inputs[0]


def run_timeout(timeout: float) -> None:
    mesh = init_mesh(2, timeout=timeout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH),
                          Hiccup(MICROBATCHES + 1, lambda: time.sleep(STALL)))
    pipe = DistributedPipe(model, mesh, [1, 1], MICROBATCHES, "gpipe")
    inputs, target = batch()
    for _ in range(2):
        pipe.step(inputs, target, F.mse_loss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", help="comma-separated: skips, hostreads, autocast, "
                                              "timeout")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {"skips": run_skips, "hostreads": run_hostreads, "autocast": run_autocast}
    with process_group(backend="gloo", timeout=max(args.timeout, 60.0)):
        for scenario in args.scenarios.split(","):
            if scenario == "timeout":
                run_timeout(args.timeout)
            else:
                runs[scenario](args.out)


if __name__ == "__main__":
    main()
