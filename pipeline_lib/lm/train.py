"""The multi-process training program: the Transformer LM on a ``dp x pp`` mesh.

    torchrun --nproc_per_node 4 -m pipeline_lib.lm.train --pp 2 --dp 2 --schedule 1f1b --chunks 4

Every rank runs this same program; `pipeline_lib.distributed.DistributedPipe` decides
which stages it holds. The loops it shares with single-process training live in
`pipeline_lib.lm.loops`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeline_lib.distributed import DistributedPipe, init_mesh, process_group
from pipeline_lib.lm.data import batchify, get_batch, load_wikitext2
from pipeline_lib.lm.loops import batch_starts, lm_loss, seed_everything
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.partition import balance_by_params, balance_by_time
from pipeline_lib.schedules import BUILDERS, stages_per_rank
from pipeline_lib.timeline import simulate_measured


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m pipeline_lib.lm.train",
        description="Train the Transformer LM on a pp-rank pipeline, replicated dp times "
        "(pp x dp processes). Rank pp-1 logs loss, tokens/s and the bubble.")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--schedule", choices=sorted(BUILDERS), default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="stages per rank, for interleaved_1f1b")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per replica")
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--bptt", type=int, default=35, help="sequence length")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--preset", default="cpu", help="pipeline_lib.lm.model.PRESETS")
    parser.add_argument("--balance", choices=["time", "params"], default="time",
                        help="split stages by measured time or by parameter count")
    parser.add_argument("--checkpoint", choices=["always", "except_last", "never"],
                        default="never")
    parser.add_argument("--synthetic", type=int, metavar="VOCAB", default=None,
                        help="random tokens from a VOCAB-word vocabulary, not WikiText-2")
    parser.add_argument("--timeline", default=None,
                        help="save the last logged step's timeline here (JSON)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any single wait may take before it is an error")
    return parser.parse_args(argv)


def _training_tokens(args: argparse.Namespace, rank: int) -> tuple[torch.Tensor, int]:
    """``[batch, n]`` token ids, the same on every rank, and the vocabulary size."""
    if args.synthetic is not None:
        g = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, args.synthetic, (args.batch * (args.steps * args.bptt + 1),),
                               generator=g)
        return batchify(tokens, args.batch), args.synthetic
    if rank != 0:
        dist.barrier()    # rank 0 downloads first, the others then read its copy
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
        logger = args.pp - 1   # replica 0's last stage: it has the loss
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
                Path(args.timeline).write_text(json.dumps(timeline.to_dict()))


if __name__ == "__main__":
    main()
