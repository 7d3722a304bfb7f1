"""The multi-process training program: the Transformer LM on a ``tp x pp x dp`` mesh.

    torchrun --nproc_per_node 4 -m pipeline_lib.lm.train --pp 2 --dp 2 --schedule 1f1b --microbatches 4

Every rank runs this same program; `pipeline_lib.distributed.DistributedPipe` decides
which stages it holds. The loops it shares with single-process training live in
`pipeline_lib.lm.loops`. What a real run needs on top of the lesson:

* the stages balanced by layer times measured on the device the job trains on, in its
  precision (``--dtype bf16``: autocast, weights float32, activations bfloat16);
* the whole model's gradient norm clipped (``--clip``, `pipeline_lib.grad_clip`);
* a learning-rate warmup and cosine decay (`loops.lr_at`);
* the validation loss, token-weighted, every ``--eval-every`` steps;
* tokens/s and, given the hardware's peak (``--peak-tflops``), the model FLOPs
  utilisation, 6 x parameters x tokens per second over the peak of every process;
* checkpoints (``--save``, ``--resume``, `pipeline_lib.run_state`) that resume on another
  ``--tp``/``--pp``/``--dp``;
* each stage split over ``--tp`` ranks (PyTorch's tensor-parallel plans,
  `pipeline_lib.parallel`; ``--sequence-parallel``), the replicas as DDP or sharded
  (``--fsdp``, ``--no-reshard-after-forward``);
* a run that diverges (a loss or gradient of NaN or inf) stops, naming the step, before
  its optimizer step, and its last good checkpoint stays (``--skip-nonfinite N`` skips up
  to N such steps instead, as large runs do for a rare bad batch);
* ``--steps`` beyond the data set's batches goes round it again (epochs).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from pipeline_lib import run_state
from pipeline_lib.distributed import DistributedPipe, init_mesh, process_group
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.lm.data import batchify, get_batch, load_wikitext2
from pipeline_lib.lm.loops import batch_starts, lm_loss, lr_at, seed_everything
from pipeline_lib.lm.model import PRESETS, transformer_lm
from pipeline_lib.lm.pipeline_eval import evaluate_pipeline
from pipeline_lib.partition import balance_by_params, balance_by_time
from pipeline_lib.schedules import BUILDERS, Schedule, plan, stages_per_rank
from pipeline_lib.timeline import simulate_measured


def _at_least_one(fix: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= 1, else an error that says what to give."""
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not "
                                             f"{text!r}: {fix}")
        return int(text)
    return parse


def _at_least_zero(what: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= 0, 0 meaning ``what``."""
    def parse(text: str) -> int:
        if not text.strip().isdigit():
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}: 0 "
                                             f"{what}")
        return int(text)
    return parse


def _number_in(low: float, high: float, fix: str, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a number in ``[low, high]`` (``(low, high]`` if ``low_open``),
    NaN refused: a NaN rate or norm would turn every weight into NaN without an error."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (low < value if low_open else low <= value) or not value <= high:
            where = f"{'above' if low_open else 'at least'} {low:g}" + (
                f" and at most {high:g}" if high != math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a number {where}, not {text!r}: {fix}")
        return value
    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed `torch.manual_seed` takes (and the validation data's seed,
    one more), else an error naming the range."""
    if not text.strip().isdigit() or int(text) > _MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to {_MAX_SEED} "
                                         f"(2**64 - 2), not {text!r}")
    return int(text)


_MAX_SEED = 2**64 - 2


def _writable_folder(parser: argparse.ArgumentParser, flag: str, folder: Path) -> None:
    """Fail now, not after minutes of training, if nothing can be written in ``folder``:
    by writing a file there (permission bits do not tell: root passes every check, and
    /proc refuses new files to root too)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as exc:
        parser.error(f"{flag}: cannot write in {folder} ({exc.strerror or exc}); choose a "
                     f"path in a folder you can write to")


class _OldNameWarns(argparse.Action):
    """Stores the value; given under an old option name (the first is the current one),
    warns that the old name goes in the next release (a `FutureWarning`: the one Python
    shows the person at the command line, not only developers)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string != self.option_strings[0]:
            warnings.warn(f"{option_string} is deprecated and will be removed in the next "
                          f"release; use {self.option_strings[0]}", FutureWarning,
                          stacklevel=2)
        setattr(namespace, self.dest, values)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m pipeline_lib.lm.train",
        description="Train the Transformer LM on a pp-rank pipeline, each stage split over "
        "tp ranks, replicated dp times (tp x pp x dp processes). Rank pp-1 logs loss, "
        "tokens/s and the bubble.")
    parser.add_argument("--pp", type=_at_least_one("1 runs every stage in one process"),
                        default=2, help="pipeline ranks")
    parser.add_argument("--dp", type=_at_least_one("1 trains a single replica"), default=1,
                        help="data-parallel replicas")
    parser.add_argument("--tp", type=_at_least_one("1 keeps every layer whole"), default=1,
                        help="tensor-parallel ranks per stage (heads, MLP units and the "
                        "vocabulary split over them; the fastest rank dimension)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: the norms, dropouts and residual adds on each tp "
                        "rank's positions (all-gather and reduce-scatter for all-reduce)")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --dp: shard each stage's weights, gradients and AdamW "
                        "states over the replicas (FSDP2, ZeRO-3) instead of DDP")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                        default=None, help="with --fsdp: free the gathered weights after "
                        "each forward (the default; gathered again for the backward), or "
                        "keep them through the step (--no-reshard-after-forward)")
    parser.add_argument("--schedule", choices=sorted(BUILDERS), default="1f1b")
    parser.add_argument("--virtual-stages", type=_at_least_one("2 is the usual choice"),
                        default=2, help="stages per rank, for interleaved_1f1b")
    parser.add_argument("--microbatches", "--chunks", dest="microbatches", default=4,
                        action=_OldNameWarns, help="micro-batches per replica (--chunks is "
                        "its old name, deprecated)",
                        type=_at_least_one("1 sends each replica's batch whole, unsplit"))
    parser.add_argument("--batch", type=_at_least_one("the global batch, in rows"),
                        default=16, help="global batch (rows)")
    parser.add_argument("--bptt", type=_at_least_one("35 is the tutorial's"), default=35,
                        help="sequence length")
    parser.add_argument("--steps", type=_at_least_one("train for at least one step"),
                        default=100)
    parser.add_argument("--lr", type=_number_in(0, math.inf, "1e-3 is the default", True),
                        default=1e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup", type=_at_least_zero("starts at the peak rate"),
                        default=10, help="steps of linear learning-rate warmup")
    parser.add_argument("--lr-floor", type=_number_in(0, 1, "a fraction of --lr; 0.1 is the "
                        "default"), default=0.1, help="the cosine decay ends "
                        "at this fraction of --lr at the last step")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast to bfloat16 (weights and optimizer stay float32; "
                        "activations, and the messages between stages, are bfloat16)")
    parser.add_argument("--clip", type=_number_in(0, math.inf, "0 turns clipping off, 0.5 is "
                        "the seeds'"), default=0.5, metavar="MAX_NORM",
                        help="clip the whole model's gradient norm (summed over the pipeline's "
                        "ranks) to MAX_NORM, as the seed tutorials do; 0 turns clipping off")
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                        help="pipeline_lib.lm.model.PRESETS")
    parser.add_argument("--balance", choices=["time", "params"], default="time",
                        help="split stages by measured time or by parameter count")
    parser.add_argument("--checkpoint", choices=["always", "except_last", "never"],
                        default="never")
    parser.add_argument("--synthetic", metavar="VOCAB", default=None,
                        type=_at_least_one("the vocabulary's size, e.g. 1000"),
                        help="random tokens from a VOCAB-word vocabulary, not WikiText-2")
    parser.add_argument("--timeline", default=None,
                        help="save the last logged step's timeline here (JSON)")
    parser.add_argument("--log-every", default=10, type=_at_least_one(
        "1 logs every step; a number above --steps logs only the last one"))
    parser.add_argument("--eval-every", default=50, type=_at_least_zero(
        "evaluates only after the last step"), help="steps between validation losses")
    parser.add_argument("--eval-steps", default=20, type=_at_least_one(
        "1 evaluates on one batch"), help="validation batches per evaluation")
    parser.add_argument("--peak-tflops", default=None, type=_number_in(
                        0, math.inf, "the device's peak, e.g. 989 for an H100 in bf16", True),
                        help="the peak TFLOP/s of one process's device in --dtype (e.g. 989 "
                        "for an H100's bf16): logs the model FLOPs utilisation (MFU)")
    parser.add_argument("--save", type=Path, default=None, metavar="DIR",
                        help="save a checkpoint into DIR after the last step (and every "
                        "--save-every steps); it resumes on any --tp/--pp/--dp")
    parser.add_argument("--save-every", default=0, type=_at_least_zero(
        "saves after the last step only"))
    parser.add_argument("--resume", type=Path, default=None, metavar="DIR",
                        help="go on from the newest checkpoint in DIR, up to --steps in all")
    parser.add_argument("--seed", type=_seed, default=0)
    parser.add_argument("--skip-nonfinite", default=0, metavar="N", type=_at_least_zero(
        "stops at the first step whose loss or gradient norm is NaN or inf"),
        help="skip (no optimizer step) up to N steps whose loss or gradient norm is NaN "
        "or inf, and stop at the next; 0 stops at the first")
    parser.add_argument("--timeout", default=300.0, type=_number_in(
                        0, math.inf, "300 is the default", True),
                        help="seconds any single wait may take before it is an error")
    args = parser.parse_args(argv)
    if args.batch < args.dp * args.microbatches:
        parser.error(f"--batch {args.batch} rows cannot give {args.dp} replica(s) "
                     f"{args.microbatches} micro-batches of at least one row each: use --batch "
                     f">= {args.dp * args.microbatches} (--dp x --microbatches) or fewer "
                     f"--microbatches")
    _check_three_d(parser, args)
    if args.save_every and not args.save:
        parser.error(f"--save-every {args.save_every} saves nowhere without --save DIR")
    if args.timeline:   # fail now, not at the first log step after minutes of training
        folder = Path(args.timeline).absolute().parent
        if Path(args.timeline).is_dir():
            parser.error(f"--timeline {args.timeline} is a folder: give a file name, "
                         f"e.g. --timeline {Path(args.timeline) / 'timeline.json'}")
        if not folder.is_dir():
            parser.error(f"--timeline {args.timeline}: folder {folder} does not exist; "
                         f"create it (mkdir -p {folder}) or choose another path")
        _writable_folder(parser, f"--timeline {args.timeline}", folder)
    if args.save:
        try:
            args.save.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--save {args.save}: cannot create the folder ({exc.strerror or exc})"
                         f"; choose a path in a folder you can write to")
        _writable_folder(parser, f"--save {args.save}", args.save)
    if args.resume and not (args.resume / run_state.LATEST).is_file():
        parser.error(f"--resume {args.resume}: no checkpoint there ({run_state.LATEST} is "
                     f"missing); give the folder of an earlier run's --save")
    if args.save and (args.save / run_state.LATEST).is_file() and not (
            args.resume and args.resume.resolve() == args.save.resolve()):
        # the first save would replace the checkpoint there, and delete its step folder
        parser.error(f"--save {args.save} already holds another run's checkpoint, which "
                     f"this run's first save would delete: go on from it with --resume "
                     f"{args.save}, or save into an empty folder")
    return args


def _check_three_d(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a tensor-parallel or sharded layout the run could not take, before any
    process waits for another; then ``--reshard-after-forward`` defaults to on."""
    if args.sequence_parallel and args.tp == 1:
        parser.error("--sequence-parallel splits each stage's positions over the "
                     "tensor-parallel ranks: give --tp 2 or more")
    if args.sequence_parallel and args.bptt % args.tp:
        parser.error(f"--sequence-parallel gives each of the --tp {args.tp} ranks "
                     f"--bptt / --tp positions: --bptt {args.bptt} does not divide by "
                     f"{args.tp}; choose a --bptt that does")
    if args.fsdp and args.dp == 1:
        parser.error("--fsdp shards the weights over the data-parallel replicas: give "
                     "--dp 2 or more")
    if args.reshard_after_forward is not None and not args.fsdp:
        parser.error("--reshard-after-forward / --no-reshard-after-forward choose what "
                     "FSDP does with the weights it gathered: add --fsdp")
    args.reshard_after_forward = args.reshard_after_forward is not False
    model = PRESETS[args.preset]
    for what, count in (("heads", model["nhead"]), ("hidden units", model["d_hid"])):
        if count % args.tp:
            parser.error(f"--tp {args.tp} cannot split the {args.preset} preset's "
                         f"{count:g} {what}: each tensor-parallel rank computes an equal "
                         f"share; choose a --tp that divides {count:g}")


def _tokens(args: argparse.Namespace, rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[batch, n]`` training and validation token ids, the same on every rank, and the
    vocabulary size."""
    if args.synthetic is not None:
        # drawn column by column, so step k's batch does not depend on --steps: a run
        # resumed with more steps goes on through the same data
        train, valid = (torch.randint(0, args.synthetic, (steps * args.bptt + 1, args.batch),
                                      generator=torch.Generator().manual_seed(seed)).T
                        for steps, seed in ((args.steps, args.seed), (args.eval_steps,
                                                                      args.seed + 1)))
        return train.contiguous(), valid.contiguous(), args.synthetic
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
    return batchify(data.train, args.batch), batchify(data.valid, args.batch), len(data.vocab)


def _whole_batches(tokens: torch.Tensor, bptt: int) -> torch.Tensor:
    """``tokens`` (``[batch, n]``) without the columns of a last batch shorter than
    ``bptt``, whose positions --sequence-parallel could not split as it splits the
    others (when there are full batches)."""
    whole = (tokens.size(1) - 1) // bptt * bptt
    return tokens[:, :whole + 1] if whole else tokens


Precision = Callable[[], ContextManager[Any]]


def _precision(dtype: str, device: torch.device) -> Precision:
    """What each forward (and the backward it records) runs under: autocast to bfloat16
    for ``bf16``, on GPUs and CPUs alike. The weights stay float32: autocast runs matmuls
    on bfloat16 copies, and the optimizer updates the float32 masters."""
    if dtype == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _balance(shapes: nn.Sequential, build: Callable[[], nn.Sequential],
             sample: tuple[torch.Tensor, torch.Tensor], stages: int, by: str,
             device: torch.device, precision: Precision) -> tuple[list[int], str]:
    """The balance, and how it was found, for the log: by the parameters of ``shapes``
    (the model on the meta device), or by time.

    Timing is noisy, so rank 0 measures and every rank uses its answer. It measures a
    model made by ``build`` on its own device (its weights are drawn there, and the
    random generators put back after: the run's weights come from the seed as if
    nothing had been timed), in the run's precision, with the loss on the last layer:
    layer times on a CPU say little about a GPU's, where the output layer and the loss
    dominate. The rank that logs is another one: the answer names rank 0's device."""
    if by == "params":
        return balance_by_params(shapes, stages), "by params"
    answer = [None]
    if dist.get_rank() == 0:
        inputs, target = sample
        gpus = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(gpus):
            with torch.device(device):
                model = build()
            with precision():
                timed = balance_by_time(model, inputs, stages, device=device,
                                        loss_fn=lm_loss, target=target)
        answer = [(timed, f"by time on {device} of rank 0")]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _layers_on(schedule: Schedule, balance: list[int], pipe_rank: int) -> set[int]:
    """The layers of the stages that ``schedule`` places on ``pipe_rank``."""
    starts = list(itertools.accumulate(balance, initial=0))
    return {layer for s in range(len(balance)) if schedule.rank_of(s) == pipe_rank
            for layer in range(starts[s], starts[s + 1])}


def _write_atomically(path: Path, text: str) -> None:
    """Write a file beside ``path``, then rename it over ``path``: a full disk or a kill
    mid-write leaves the last good timeline whole, never a truncated one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _log(line: str) -> None:
    tqdm.write(line)   # above the progress bar, not through it


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    with process_group(timeout=args.timeout), contextlib.ExitStack() as held:
        mesh = init_mesh(args.pp, args.dp, args.timeout, tp=args.tp)
        if args.save and mesh.rank == 0:
            held.enter_context(run_state.claimed(args.save))
        source, valid, vocab = _tokens(args, mesh.rank)
        if args.sequence_parallel:   # every batch splits into --tp equal position shares
            source, valid = (_whole_batches(t, args.bptt) for t in (source, valid))
        seed_everything(args.seed)
        with torch.device("meta"):   # the layers' shapes: no memory, no random draw
            shapes = transformer_lm(vocab, args.preset)
        parameters = sum(p.numel() for p in shapes.parameters())
        stages = args.pp * stages_per_rank(args.schedule, args.virtual_stages)
        precision = _precision(args.dtype, mesh.device)
        rows = max(1, args.batch // (args.dp * args.microbatches))   # one micro-batch
        sample = tuple(t[:rows] for t in get_batch(source, 0, args.bptt))
        balance, balanced = _balance(shapes, lambda: transformer_lm(vocab, args.preset),
                                     sample, stages, args.balance, mesh.device, precision)
        # this rank's layers only, with the weights the whole model gets from the seed
        mine = _layers_on(plan(args.schedule, args.pp, stages, args.microbatches), balance,
                          mesh.pipe_rank)
        model = transformer_lm(vocab, args.preset, layers=mine)
        pipe = DistributedPipe(model, mesh, balance, args.microbatches, args.schedule,
                               args.checkpoint, sequence_parallel=args.sequence_parallel,
                               shard_parameters=args.fsdp,
                               reshard_after_forward=args.reshard_after_forward)
        del model
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
        done = run_state.resume(args.resume, pipe, balance, optimizer) if args.resume else 0
        # replica 0's rank holding the last stage (tp rank 0 of it) has the loss: the last
        # pipe rank on a looped schedule, pipe rank 0 on a V (zb_v, dualpipe_v)
        logger = mesh.at(0, pipe.schedule.rank_of(pipe.schedule.stages - 1), 0)
        # step k's batch starts at column batches[(k - 1) % len(batches)]: past the end of
        # the split, it goes round again (an epoch more), whatever --steps says
        batches, steps = batch_starts(source, args.bptt, None), args.steps
        if done >= steps:
            raise ValueError(f"the checkpoint in {args.resume} has run {done} steps "
                             f"already, and this run has --steps {steps} in all: raise "
                             f"--steps to go on")
        if mesh.rank == logger:
            _log(f"{pipe.schedule.name}: {args.pp} pipeline ranks x {args.dp} replicas"
                 + (f" x {args.tp} tensor-parallel ranks" if args.tp > 1 else "")
                 + (", sequence parallel" if args.sequence_parallel else "")
                 + (", FSDP" if args.fsdp else "") + ", "
                 f"stages {balance} ({balanced}), {args.microbatches} "
                 f"micro-batches, {args.dtype}, {parameters:,} parameters"
                 + (f", resumed after step {done}" if args.resume else ""))
            if steps > len(batches):
                _log(f"--steps {steps} goes {steps / len(batches):.2f} times over the "
                     f"training data's {len(batches)} batches (epochs)")
        skipped = 0
        bar = tqdm(range(done, steps), desc="train", initial=done, total=steps,
                   disable=mesh.rank != logger)
        for step in (i + 1 for i in bar):
            lr = lr_at(step - 1, args.lr, args.warmup, steps, args.lr_floor)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, targets = get_batch(source, batches[(step - 1) % len(batches)], args.bptt)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with precision():
                loss = pipe.step(inputs, targets, lm_loss)
            norm = clip_grad_norm_(pipe, args.clip) if args.clip else None
            diverged = _nonfinite(loss, norm, pipe)
            if diverged:
                skipped += 1
                _stop_or_skip(step, diverged, skipped, args, mesh.rank == logger)
            else:
                optimizer.step()
            if mesh.device.type == "cuda":   # time the update's kernels, not their launch
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            last = step == steps
            if args.save and (last or (args.save_every and step % args.save_every == 0)):
                run_state.save(args.save, step, pipe, balance, optimizer)
            if last or (args.eval_every and step % args.eval_every == 0):
                valid_loss, valid_ppl = evaluate_pipeline(pipe, valid, args.bptt,
                                                          max_steps=args.eval_steps,
                                                          precision=precision)
                if mesh.rank == logger:
                    _log(f"valid loss {valid_loss:.3f}  ppl {valid_ppl:,.1f}  after step {step}")
            if step % args.log_every and not last:
                continue
            timeline = pipe.gather_timeline(dst=logger)
            if timeline is None:
                continue
            bar.set_postfix(loss=f"{loss.item():.3f}")
            _log(_step_line(step, loss.item(), lr, norm, targets.numel(), seconds, parameters,
                            args.peak_tflops, mesh.pp * mesh.dp * mesh.tp)
                 + f"  bubble {timeline.bubble_fraction():.1%} measured, "
                 f"{simulate_measured(pipe.schedule, timeline).bubble_fraction():.1%} simulated")
            if args.timeline:
                _write_atomically(Path(args.timeline), json.dumps(timeline.to_dict()))


def _nonfinite(loss: torch.Tensor | None, norm: torch.Tensor | None,
               pipe: DistributedPipe) -> str | None:
    """What is NaN or inf this step, on any rank: the loss (on the ranks holding the last
    stage) or the gradients (their norm, clipped or not). One all-reduce and one host
    read per step, whatever the micro-batches."""
    if norm is None:   # no clipping: the largest gradient, which NaN and inf reach too
        grads = [p.grad for p in pipe.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, math.inf) if grads else None
    device = pipe.mesh.device
    bad = torch.zeros(2, device=device)
    for k, value in enumerate((loss, norm)):
        if value is not None:
            bad[k] = (~value.to(device).isfinite()).float()
    dist.all_reduce(bad)
    loss_bad, grads_bad = bad.tolist()
    found = [what for what, b in (("loss", loss_bad), ("gradient norm", grads_bad)) if b]
    if not found:
        return None
    return f"the {' and the '.join(found)} {'are' if len(found) > 1 else 'is'} NaN or inf"


def _stop_or_skip(step: int, diverged: str, skipped: int, args: argparse.Namespace,
                  logs: bool) -> None:
    """Skip step ``step``, whose ``diverged`` (no optimizer step), if ``--skip-nonfinite``
    allows one more, saying so; else stop the run, on every rank, before its weights turn
    NaN: the last checkpoint saved stays the newest."""
    if skipped > args.skip_nonfinite:
        latest = [folder / run_state.LATEST for folder in (args.save, args.resume)
                  if folder and (folder / run_state.LATEST).is_file()]
        kept = (f"the newest checkpoint, {latest[0].parent / latest[0].read_text().strip()}, "
                f"is kept: resume from it" if latest else "start again")
        raise RuntimeError(
            f"step {step}: {diverged}: the run has diverged (or met a bad batch), and "
            f"stops before this step's update ({skipped - 1} such step(s) skipped so far, "
            f"--skip-nonfinite {args.skip_nonfinite}); {kept} with a lower --lr (now "
            f"{args.lr:g}) or --clip, or let --skip-nonfinite N skip up to N such steps")
    if logs:
        _log(f"step {step:>5}  skipped: {diverged} ({skipped} of at most "
             f"{args.skip_nonfinite} skipped)")


def _step_line(step: int, loss: float, lr: float, norm: torch.Tensor | None, tokens: int,
               seconds: float, parameters: int, peak_tflops: float | None,
               processes: int) -> str:
    """One step's log: the model FLOPs utilisation counts 6 FLOPs per parameter and token
    (2 forward, 4 backward; attention's own FLOPs left out), over every process's peak."""
    line = f"step {step:>5}  loss {loss:.3f}  lr {lr:.2e}"
    if norm is not None:
        line += f"  grad norm {norm.item():.3f}"
    line += f"  {tokens / seconds:,.0f} tokens/s"
    if peak_tflops:
        line += f"  MFU {6 * parameters * tokens / seconds / (peak_tflops * 1e12 * processes):.1%}"
    return line


if __name__ == "__main__":
    main()
