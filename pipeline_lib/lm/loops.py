"""Training and evaluation loops that work for a plain model and for a pipeline alike.

The loops never touch a model's internals. They only need one of two things:

* a **forward** callable ``model(inputs) -> logits`` (an ``nn.Module``, or a pipeline's
  forward) together with an ``optimizer``: the loop then computes the loss, calls
  ``backward``, clips the gradients and steps the optimizer itself (:func:`make_step`);
* or a **step** callable ``step(inputs, targets) -> loss`` and no optimizer: the step
  does its own forward, backward and update, which is how pipeline schedules work
  (they interleave micro-batch forwards and backwards internally).

A step may return ``None`` instead of a loss, and a forward passed to :func:`evaluate`
``None`` instead of logits: that is what a pipeline rank without the last stage sees.
Such batches are not counted, so the same loop runs unchanged on every rank.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from pipeline_lib.lm.data import get_batch

Forward = Callable[[torch.Tensor], torch.Tensor | None]
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float | None]


def lm_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``[B, T, V]`` logits against ``[B, T]`` next-token ids.

    ``"mean"`` averages over every target token; ``"sum"`` lets callers weight batches of
    different sizes correctly (see :func:`evaluate`).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: expected "
            "logits [B, T, V] for target [B, T] (both batch-first, as get_batch returns)."
        )
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction=reduction)


def make_step(model: Forward, optimizer: torch.optim.Optimizer, clip: float | None = 0.5) -> Step:
    """Wrap a forward callable into the standard step: loss, backward, clip, update.

    Gradients are clipped over the optimizer's parameters rather than ``model.parameters()``
    so that ``model`` can be any callable returning logits, e.g. a single-process pipeline
    whose ``pipe(x)`` returns the last stage's output. (A multi-process pipeline needs the
    gradient norm summed across stages, so it belongs in that pipeline's own step.)
    """
    if clip is not None and not (isinstance(clip, numbers.Real) and not isinstance(clip, bool)
                                 and clip > 0):
        # torch clips to 0 (no update at all) or, below 0, flips every gradient's sign
        raise ValueError(f"clip must be a max norm > 0 (0.5 is the tutorial's) or None for "
                         f"no clipping, got {clip!r}")
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        if logits is None:
            raise TypeError(
                "The model returned None instead of logits. A pipeline stage that does not "
                "produce logits must be trained by its own step(inputs, targets) function "
                "(passed without an optimizer), not by make_step."
            )
        loss = lm_loss(logits, targets)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        return loss.detach()

    return step


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's RNGs so initialisation and dropout repeat run to run."""
    random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning rate of step ``step`` (counted from 0) of ``total``: a linear warmup
    from ``peak / warmup`` to ``peak`` over the first ``warmup`` steps, then a cosine
    decay to ``floor * peak`` at the last step.

    The warmup lets AdamW's moment estimates settle before the steps get large (its first
    updates have size ~lr whatever the gradient); the decay lets the loss settle into a
    minimum instead of bouncing around it at the peak rate. A pure function of the step,
    so a resumed run needs no scheduler state to go on where it stopped.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    decaying = max(total - warmup - 1, 1)
    progress = min((step - warmup) / decaying, 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_starts(source: torch.Tensor, bptt: int, max_steps: int | None) -> range:
    """The start column of each batch; at least one (a loop over none would report a
    loss of NaN, or divide by zero, rather than say the data is too short)."""
    if isinstance(bptt, bool) or not isinstance(bptt, numbers.Integral) or bptt < 1:
        raise ValueError(f"bptt must be a whole number >= 1 (tokens per sequence, 35 in "
                         f"the tutorial), got {bptt!r}")
    if max_steps is not None and (isinstance(max_steps, bool)
                                  or not isinstance(max_steps, numbers.Integral)
                                  or max_steps < 1):
        raise ValueError(f"max_steps must be >= 1 (or None for the whole split), got {max_steps}.")
    if source.dim() != 2 or source.size(1) < 2:
        raise ValueError(f"source {tuple(source.shape)} holds no batch: it must be [batch, n] "
                         f"from batchify with n >= 2 (an input token and its target); give "
                         f"more tokens or a smaller batch size")
    starts = range(0, source.size(1) - 1, bptt)
    return starts if max_steps is None else starts[:max_steps]


def train_epoch(
    model_or_step: Forward | Step,
    source: torch.Tensor,
    bptt: int,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    clip: float | None = 0.5,
    max_steps: int | None = None,
    progress: bool = True,
) -> list[float]:
    """One pass over ``source`` (``[B, N]`` from ``batchify``), returning every step's loss.

    Pass a forward callable plus ``optimizer``, or a self-updating ``step`` and no
    optimizer (see the module docstring). ``max_steps`` stops early, for demos and tests.
    """
    if optimizer is not None:
        step = make_step(model_or_step, optimizer, clip)
    elif isinstance(model_or_step, nn.Module):
        raise TypeError(
            "train_epoch got a model but no optimizer: pass optimizer=..., or pass a "
            "step(inputs, targets) function that runs backward and updates the weights itself."
        )
    else:
        step = model_or_step
    if isinstance(model_or_step, nn.Module):
        model_or_step.train()
    losses: list[float] = []
    bar = tqdm(batch_starts(source, bptt, max_steps), desc="train", disable=not progress)
    for i in bar:
        loss = step(*get_batch(source, i, bptt))
        if loss is None:
            continue
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(
                f"Loss became {losses[-1]} at step {len(losses)}; lower the learning rate "
                "or clip gradients harder."
            )
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


@torch.no_grad()
def evaluate(
    model: Forward,
    source: torch.Tensor,
    bptt: int,
    *,
    max_steps: int | None = None,
    progress: bool = False,
) -> tuple[float, float]:
    """Mean next-token loss over every target token in ``source``, and its perplexity.

    Token-weighted: per-token losses are summed over all batches and divided by the
    number of target tokens, so a short final batch counts exactly as much as its tokens.
    The pipeline tutorial got this wrong: it weighted each batch by ``len(data)``, which
    after its transpose is the batch size rather than the sequence length, and divided by
    the length of the whole split although it evaluated only 50 batches, which reported
    perplexities of 1.2-2 for an undertrained model.

    Returns ``(nan, nan)`` if ``model`` never produced logits (a non-final pipeline rank).
    """
    was_training = isinstance(model, nn.Module) and model.training
    if isinstance(model, nn.Module):
        model.eval()
    total, count = 0.0, 0
    try:
        for i in tqdm(batch_starts(source, bptt, max_steps), desc="eval", disable=not progress):
            inputs, targets = get_batch(source, i, bptt)
            logits = model(inputs)
            if logits is None:
                continue
            total += lm_loss(logits, targets, reduction="sum").item()
            count += targets.numel()
    finally:
        if isinstance(model, nn.Module):
            model.train(was_training)
    if count == 0:
        return math.nan, math.nan
    mean = total / count
    return mean, math.exp(mean)


@dataclass
class EpochStats:
    """One row of :func:`fit`'s history; flat fields so a list of them tabulates directly."""

    epoch: int
    train_loss: float  # mean of the epoch's step losses (weights still changing)
    valid_loss: float
    valid_ppl: float
    seconds: float


def fit(
    model: nn.Module,
    train_data: torch.Tensor,
    valid_data: torch.Tensor,
    *,
    bptt: int = 35,
    epochs: int = 1,
    lr: float = 1e-3,
    clip: float | None = 0.5,
    seed: int = 0,
    max_steps: int | None = None,
    progress: bool = True,
) -> list[EpochStats]:
    """Train ``model`` with AdamW and report validation loss after each epoch.

    Called ``fit`` rather than ``train`` because `pipeline_lib.lm.train` is the
    ``torchrun`` program, a different thing.

    AdamW at 1e-3 rather than the tutorial's SGD at lr=5.0. That SGD rate was tuned for
    the small 200-wide model; on the 4096-wide model the tutorial's init gave logits
    with std ~3.7 (4096 unit-variance features x uniform(+-0.1) weights; our `Decoder`
    scales its init with the width instead), the first gradients were large and SGD at
    5.0 diverged, while Adam's per-parameter step size is insensitive to gradient scale. ``seed`` fixes dropout; seed model construction
    yourself (:func:`seed_everything`) to fix initialisation too. ``max_steps`` caps both
    the training and the validation batches of each epoch.
    """
    seed_everything(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history = []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        losses = train_epoch(
            model, train_data, bptt, optimizer, clip=clip, max_steps=max_steps, progress=progress
        )
        valid_loss, valid_ppl = evaluate(
            model, valid_data, bptt, max_steps=max_steps, progress=progress
        )
        history.append(
            EpochStats(
                epoch=epoch,
                train_loss=sum(losses) / len(losses),
                valid_loss=valid_loss,
                valid_ppl=valid_ppl,
                seconds=time.perf_counter() - start,
            )
        )
    return history
