"""The vocabulary projection and its loss, computed a slice of the sequence at a time.

A language model's largest tensors are at its very end: the logits ``[B, T, V]`` and,
during the backward, their gradient, both ``V / d_model`` times the size of the body's
output (V = 33k words against d_model = 128 is 260 times). Autograd keeps all of them
alive at once. Nothing forces that: each position's loss depends on that position's
logits only, so

1. run the body once and cut its output off the graph, as a leaf that requires grad;
2. for each slice of ``chunk`` positions: project to logits, take the slice's share of
   the mean loss, and backward it at once. This accumulates the projection's weight
   gradients and the leaf's gradient for those positions, and frees the slice's logits
   before the next slice makes its own;
3. backward through the body once, from the leaf's gradient.

The gradients are those of the unchunked loss (a sum splits into partial sums), while the
logits alive at any moment shrink from T positions to ``chunk``. Today's fused "chunked
cross-entropy" kernels do the same; `multi_device_loss` splits the rows over devices as
well, as the Annotated Transformer's ``MultiGPULossCompute`` does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


IGNORE_INDEX = -100   # F.cross_entropy's default: a target equal to it counts for nothing


def check_loss_inputs(features: Tensor, target: Tensor, chunk: int) -> None:
    """Raise a ValueError that says what to fix if ``features``, ``target`` and ``chunk``
    cannot go through `chunked_loss_backward` (checked before any work is split up)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions (an int), got "
                         f"{chunk!r}")
    if features.shape[:-1] != target.shape:
        raise ValueError(f"features {tuple(features.shape)} and target "
                         f"{tuple(target.shape)} disagree: expected features [B, T, D] "
                         f"for target [B, T]")
    if target.numel() == 0:
        raise ValueError(f"the batch is empty (target of shape {tuple(target.shape)}): a "
                         f"mean over no token is undefined; pass at least one row and one "
                         f"position (an empty last batch: leave it out)")


def counted_tokens(target: Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """The number of targets the mean loss divides by: those that are not padding."""
    tokens = int((target != ignore_index).sum())
    if tokens == 0:
        raise ValueError(f"every target is ignore_index ({ignore_index}): a mean over no "
                         f"tokens is undefined; leave such batches out")
    return tokens


def chunked_loss_backward(features: Tensor, head: nn.Module, target: Tensor,
                          chunk: int, *, ignore_index: int = IGNORE_INDEX,
                          tokens: int | None = None) -> Tensor:
    """Backward the mean cross-entropy of ``head(features)`` against ``target`` through
    ``head`` in slices of ``chunk`` positions, then once through whatever computed
    ``features``. Returns the loss, detached.

    ``features`` is ``[B, T, D]`` (batch first), still attached to the body's graph;
    ``target`` is ``[B, T]`` token ids, where ``ignore_index`` marks padding. The mean
    divides by ``tokens``, by default ``target``'s count of real tokens; a caller that
    computes one part of a larger batch passes the whole batch's count, so that the
    parts' losses and gradients are shares of one mean and simply add up.
    """
    check_loss_inputs(features, target, chunk)
    if tokens is None:
        tokens = counted_tokens(target, ignore_index)
    leaf = features.detach().requires_grad_(features.requires_grad)
    total = torch.zeros((), device=features.device)
    for start in range(0, target.size(1), chunk):
        positions = slice(start, start + chunk)
        # Unnamed, the logits are freed as soon as the loss has their log-softmax.
        part = F.cross_entropy(head(leaf[:, positions]).flatten(0, 1),
                               target[:, positions].flatten(), reduction="sum",
                               ignore_index=ignore_index) / tokens
        part.backward()
        total += part.detach()
    if features.requires_grad:
        features.backward(leaf.grad)
    return total


def lm_backward(model: nn.Sequential, inputs: Tensor, target: Tensor,
                chunk: int | None = None) -> Tensor:
    """One forward and backward of a language model whose last layer is the vocabulary
    projection (`models.transformer_lm`): plain when ``chunk`` is None, else with the
    projection and loss in slices of ``chunk`` positions. Returns the loss, detached."""
    if chunk is None:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), target.flatten())
        loss.backward()
        return loss.detach()
    body, head = model[:-1], model[-1]
    return chunked_loss_backward(body(inputs), head, target, chunk)
