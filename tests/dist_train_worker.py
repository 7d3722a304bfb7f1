"""One rank of the multi-process tests of a real run: global gradient clipping and
checkpoints that resume on another layout. `test_grad_clip.py` and `test_run_state.py`
launch it with torchrun, on gloo.

``--scenario clip --out DIR`` (4 processes; 2 on GPUs: meshes 2x1 and 1x2, `CLIP_MESHES`):
on meshes 4x1 and 2x2, every schedule (V
schedules too: a rank holds two stages), one step of a tiny LM, then `clip_grad_norm_` with
the 2-norm and the inf-norm, clipping active; each rank saves the norm and its clipped
gradients by the unpipelined model's names.

Then, in the same launch (`run_bf16`), one 1F1B step
of two 4-rank pipelines under ``torch.autocast("cpu", torch.bfloat16)``; each rank saves
the dtypes of the tensors it sent and received, of its weights and gradients, and the loss.

``--scenario resume --phase save --out DIR`` (4 processes) trains 1F1B runs for `STEPS`
steps and saves after `SAVED_AT` (`RUNS`); ``--phase resume`` (2 processes) and the end
of ``save`` resume saved runs on other layouts; ``--phase gpu`` is `make gpu-check`'s (2
GPUs). Each run's per-step losses land in ``DIR/{run}.json``. ``--backend default`` lets
`process_group` choose (NCCL where every process has a GPU); the tests on CPUs use gloo.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline_lib import run_state
from pipeline_lib.distributed import DistributedPipe
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import init_mesh
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.schedules import stages_per_rank

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_worker import MICROBATCHES, SEQ, batch, tiny_lm, token_loss  # noqa: E402

CLIP_SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"]
NORMS = {"2": 2.0, "inf": math.inf}
CLIP = {"2": 0.05, "inf": 0.005}   # far below the tiny LM's first norms: clipping is active
STEPS, SAVED_AT, ROWS, LR, RESUME_CLIP = 4, 2, 16, 0.01, 0.5
DROPOUT = 0.2
# run name -> (pp, dp, dropout, checkpoint to resume from or None)
RUNS = {"save": {"4x1": (4, 1, 0.0, None), "2x2": (2, 2, 0.0, None),
                 "2x2-dropout": (2, 2, DROPOUT, None),
                 "2x2-to-4x1": (4, 1, 0.0, "2x2"),
                 "2x2-dropout-to-2x2": (2, 2, DROPOUT, "2x2-dropout")},
        "resume": {"2x2-to-1x2": (1, 2, 0.0, "2x2"), "4x1-to-2x1": (2, 1, 0.0, "4x1")},
        # make gpu-check, on 2 GPUs: NCCL, CUDA's dropout streams, a changed dp
        "gpu": {"2x1": (2, 1, 0.0, None), "2x1-to-1x2": (1, 2, 0.0, "2x1"),
                "2x1-dropout": (2, 1, DROPOUT, None),
                "2x1-dropout-to-2x1": (2, 1, DROPOUT, "2x1-dropout")}}


def even_balance(layers: int, stages: int) -> list[int]:
    return [layers // stages] * stages


CLIP_MESHES = {4: ((4, 1), (2, 2)), 2: ((2, 1), (1, 2))}   # by the number of processes


def run_clip(out: Path) -> None:
    inputs, target = batch()
    for pp, dp in CLIP_MESHES[dist.get_world_size()]:
        mesh = init_mesh(pp, dp, timeout=60)
        for name in CLIP_SCHEDULES:
            for norm in NORMS:
                model = tiny_lm()
                names = {id(p): n for n, p in model.named_parameters()}
                balance = even_balance(len(model), pp * stages_per_rank(name))
                pipe = DistributedPipe(model, mesh, balance, MICROBATCHES, name)
                pipe.step(inputs, target, token_loss)
                total = clip_grad_norm_(pipe, CLIP[norm], NORMS[norm])
                torch.save({"norm": total.item(), "backend": dist.get_backend(),
                            "device": str(mesh.device), "current_gpu": _current_gpu(),
                            "grads": {names[id(p)]: p.grad.cpu() for p in pipe.parameters()}},
                           out / f"{pp}x{dp}-{name}-{norm}-rank{mesh.rank}.pt")


def run_bf16(out: Path) -> None:
    """Two pipelines under autocast: the tiny LM, whose residual stream stays float32 (its
    blocks end in a LayerNorm, which autocast runs in float32), and four Linear layers,
    whose outputs autocast makes bfloat16, so that bfloat16 messages cross every link."""
    pp = dist.get_world_size()
    mesh = init_mesh(pp, 1, timeout=60)
    inputs, target = batch()
    torch.manual_seed(0)
    linears = torch.nn.Sequential(*(torch.nn.Linear(SEQ, SEQ) for _ in range(pp)))
    for name, model, data, loss_fn in (
            ("lm", tiny_lm(), (inputs, target), token_loss),
            ("linear", linears, (inputs.float(), target.float()), torch.nn.functional.mse_loss)):
        pipe = DistributedPipe(model, mesh, even_balance(len(model), pp), MICROBATCHES, "1f1b")
        seen: dict[str, list[str]] = {"sent": [], "received": []}
        send, receive = pipe.transport.send, pipe.transport.receive

        def sending(dst, message, value, send=send, seen=seen):  # type: ignore[no-untyped-def]
            seen["sent"] += [f"{message.kind}:{d}" for d in _dtypes(value)]
            return send(dst, message, value)

        def receiving(src, message, receive=receive, seen=seen):  # type: ignore[no-untyped-def]
            value = receive(src, message)
            seen["received"] += [f"{message.kind}:{d}" for d in _dtypes(value)]
            return value

        pipe.transport.send, pipe.transport.receive = sending, receiving
        with torch.autocast(mesh.device.type, dtype=torch.bfloat16):
            loss = pipe.step(*data, loss_fn)
        torch.save({**seen, "loss": None if loss is None else loss.item(),
                    "weights": sorted({str(p.dtype) for p in pipe.parameters()}),
                    "grads": sorted({str(p.grad.dtype) for p in pipe.parameters()})},
                   out / f"bf16-{name}-rank{mesh.rank}.pt")


def _dtypes(value: object) -> list[str]:
    items = value if isinstance(value, tuple) else (value,)
    return [str(t.dtype) for t in items if isinstance(t, torch.Tensor)]


def _current_gpu() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def step_batch(step: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, vocab, (ROWS, SEQ), generator=g),
            torch.randint(0, vocab, (ROWS, SEQ), generator=g))


def train(out: Path, run: str, pp: int, dp: int, dropout: float, source: str | None) -> None:
    """``STEPS`` steps in all: from scratch (saving after ``SAVED_AT`` into ``out/run``) or
    resumed from ``out/source``'s checkpoint. Losses in ``out/run.json``."""
    mesh = init_mesh(pp, dp, timeout=60)
    model = tiny_lm(dropout)   # seeds torch's generator, as a fresh run does
    balance = even_balance(len(model), pp)
    pipe = DistributedPipe(model, mesh, balance, MICROBATCHES, "1f1b")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    done = run_state.resume(out / source, pipe, balance, optimizer) if source else 0
    losses = []
    for step in range(done, STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = pipe.step(*step_batch(step), token_loss)
        clip_grad_norm_(pipe, RESUME_CLIP)
        optimizer.step()
        losses.append(None if loss is None else loss.item())
        if source is None and step + 1 == SAVED_AT:
            run_state.save(out / run, SAVED_AT, pipe, balance, optimizer)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    if mesh.rank == 0:   # the ranks holding the last stage have the losses
        replica_0 = next(ls for ls in gathered if ls[0] is not None)
        (out / f"{run}.json").write_text(json.dumps(replica_0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=["clip", "resume"])
    parser.add_argument("--phase", choices=sorted(RUNS), default="save")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--backend", default="gloo",
                        help="'default': NCCL with a GPU per process, as a real run picks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(backend=None if args.backend == "default" else args.backend,
                       timeout=60):
        if args.scenario == "clip":
            run_clip(args.out)
            run_bf16(args.out)   # one launch fewer for the tests
        else:
            for run, layout in RUNS[args.phase].items():
                train(args.out, run, *layout)


if __name__ == "__main__":
    main()
