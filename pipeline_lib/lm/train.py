"""The multi-process training program: the Transformer LM on a ``dp x pp`` mesh.

    torchrun --nproc_per_node 4 -m pipeline_lib.lm.train --pp 2 --dp 2 --schedule 1f1b --chunks 4

Every rank runs this same program; `pipeline_lib.distributed.DistributedPipe` decides
which stages it holds. The loops it shares with single-process training live in
`pipeline_lib.lm.loops`.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pipeline_lib.distributed import DistributedPipe, init_mesh, process_group
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.lm.data import batchify, get_batch, load_wikitext2
from pipeline_lib.lm.loops import batch_starts, lm_loss, seed_everything
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.partition import balance_by_params, balance_by_time
from pipeline_lib.schedules import BUILDERS, stages_per_rank
from pipeline_lib.timeline import simulate_measured


def _at_least_one(fix: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= 1, else an error that says what to give."""
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not "
                                             f"{text!r}: {fix}")
        return int(text)
    return parse


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m pipeline_lib.lm.train",
        description="Train the Transformer LM on a pp-rank pipeline, replicated dp times "
        "(pp x dp processes). Rank pp-1 logs loss, tokens/s and the bubble.")
    parser.add_argument("--pp", type=_at_least_one("1 runs every stage in one process"),
                        default=2, help="pipeline ranks")
    parser.add_argument("--dp", type=_at_least_one("1 trains a single replica"), default=1,
                        help="data-parallel replicas")
    parser.add_argument("--schedule", choices=sorted(BUILDERS), default="1f1b")
    parser.add_argument("--virtual-stages", type=_at_least_one("2 is the usual choice"),
                        default=2, help="stages per rank, for interleaved_1f1b")
    parser.add_argument("--chunks", default=4, help="micro-batches per replica",
                        type=_at_least_one("1 sends each replica's batch whole, unsplit"))
    parser.add_argument("--batch", type=_at_least_one("the global batch, in rows"),
                        default=16, help="global batch (rows)")
    parser.add_argument("--bptt", type=_at_least_one("35 is the tutorial's"), default=35,
                        help="sequence length")
    parser.add_argument("--steps", type=_at_least_one("train for at least one step"),
                        default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=0.5, metavar="MAX_NORM",
                        help="clip the whole model's gradient norm (summed over the pipeline's "
                        "ranks) to MAX_NORM, as the seed tutorials do; 0 turns clipping off")
    parser.add_argument("--preset", default="cpu", help="pipeline_lib.lm.model.PRESETS")
    parser.add_argument("--balance", choices=["time", "params"], default="time",
                        help="split stages by measured time or by parameter count")
    parser.add_argument("--checkpoint", choices=["always", "except_last", "never"],
                        default="never")
    parser.add_argument("--synthetic", type=int, metavar="VOCAB", default=None,
                        help="random tokens from a VOCAB-word vocabulary, not WikiText-2")
    parser.add_argument("--timeline", default=None,
                        help="save the last logged step's timeline here (JSON)")
    parser.add_argument("--log-every", default=10, type=_at_least_one(
        "1 logs every step; a number above --steps logs only the last one"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any single wait may take before it is an error")
    args = parser.parse_args(argv)
    if args.timeline:   # fail now, not at the first log step after minutes of training
        folder = Path(args.timeline).absolute().parent
        if Path(args.timeline).is_dir():
            parser.error(f"--timeline {args.timeline} is a folder: give a file name, "
                         f"e.g. --timeline {Path(args.timeline) / 'timeline.json'}")
        if not folder.is_dir():
            parser.error(f"--timeline {args.timeline}: folder {folder} does not exist; "
                         f"create it (mkdir -p {folder}) or choose another path")
        if not os.access(folder, os.W_OK):
            parser.error(f"--timeline {args.timeline}: cannot write in {folder}; choose a "
                         f"path in a folder you can write to")
    return args


def _training_tokens(args: argparse.Namespace, rank: int) -> tuple[torch.Tensor, int]:
    """``[batch, n]`` token ids, the same on every rank, and the vocabulary size."""
    if args.synthetic is not None:
        g = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, args.synthetic, (args.batch * (args.steps * args.bptt + 1),),
                               generator=g)
        return batchify(tokens, args.batch), args.synthetic
    if rank != 0:   # rank 0 downloads first, the others then read its copy
        try:
            dist.barrier()
        except RuntimeError as exc:
            exc.add_note(f"rank {rank} was waiting for rank 0 to download WikiText-2 (or "
                         f"to fail to): download it before launching, with python -c "
                         f"'from pipeline_lib.lm.data import load_wikitext2; "
                         f"load_wikitext2()', or raise --timeout ({args.timeout:g} s)")
            raise
    data = load_wikitext2()
    if rank == 0:
        dist.barrier()
    return batchify(data.train, args.batch), len(data.vocab)


def _balance(model: nn.Module, sample: torch.Tensor, stages: int, by: str) -> list[int]:
    """Timing is noisy, so rank 0 measures and every rank uses its answer."""
    if by == "params":
        return balance_by_params(model, stages)
    answer = [balance_by_time(model, sample, stages) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _write_atomically(path: Path, text: str) -> None:
    """Write a file beside ``path``, then rename it over ``path``: a full disk or a kill
    mid-write leaves the last good timeline whole, never a truncated one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    with process_group(timeout=args.timeout):
        mesh = init_mesh(args.pp, args.dp, args.timeout)
        source, vocab = _training_tokens(args, mesh.rank)
        seed_everything(args.seed)
        model = transformer_lm(vocab, args.preset)
        stages = args.pp * stages_per_rank(args.schedule, args.virtual_stages)
        sample = get_batch(source, 0, args.bptt)[0][:max(1, args.batch // (args.dp * args.chunks))]
        balance = _balance(model, sample, stages, args.balance)
        pipe = DistributedPipe(model, mesh, balance, args.chunks, args.schedule, args.checkpoint)
        del model   # this rank keeps only its stages
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
        # replica 0's rank holding the last stage has the loss: the last rank on a looped
        # schedule, rank 0 on a V (zb_v, dualpipe_v)
        logger = pipe.schedule.rank_of(pipe.schedule.stages - 1)
        if mesh.rank == logger:
            print(f"{pipe.schedule.name}: {args.pp} pipeline ranks x {args.dp} replicas, "
                  f"stages {balance} (by {args.balance}), {args.chunks} micro-batches",
                  flush=True)
        starts = batch_starts(source, args.bptt, args.steps)
        for step, i in enumerate(starts, 1):
            inputs, targets = get_batch(source, i, args.bptt)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = pipe.step(inputs, targets, lm_loss)
            if args.clip:
                clip_grad_norm_(pipe, args.clip)
            optimizer.step()
            seconds = time.perf_counter() - start
            if step % args.log_every and step != len(starts):
                continue
            timeline = pipe.gather_timeline(dst=logger)
            if timeline is None:
                continue
            simulated = simulate_measured(pipe.schedule, timeline)
            print(f"step {step:>5}  loss {loss.item():.3f}  "
                  f"{targets.numel() / seconds:,.0f} tokens/s  bubble "
                  f"{timeline.bubble_fraction():.1%} measured, "
                  f"{simulated.bubble_fraction():.1%} simulated", flush=True)
            if args.timeline:
                _write_atomically(Path(args.timeline), json.dumps(timeline.to_dict()))


if __name__ == "__main__":
    main()
