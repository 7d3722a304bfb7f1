"""`memory.CountedLoss` counts what a loss saves for its backward, once per tensor, and
stops counting it when the backward frees it."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from pipeline_lib.memory import CountedLoss


def test_cross_entropy_holds_its_log_probabilities_once_until_the_backward():
    logits = torch.randn(64, 1000, requires_grad=True)
    target = torch.randint(1000, (64,))
    counted = CountedLoss(F.cross_entropy)
    loss = counted(logits, target)
    log_probs = logits.numel() * 4            # float32, saved by log_softmax and by nll_loss
    assert log_probs <= counted.held < 1.01 * log_probs    # the target's ids: 512 bytes
    loss.backward()
    assert counted.held == 0
    assert log_probs <= counted.peak < 1.01 * log_probs


def test_peaks_add_up_over_calls_held_at_once():
    counted = CountedLoss(lambda x: (x.exp() * x).sum())  # saves exp(x) and x's copy: 2 tensors
    xs = [torch.randn(100, requires_grad=True) for _ in range(3)]
    losses = [counted(x) for x in xs]
    per_call = counted.peak / 3
    assert counted.held == counted.peak and per_call >= 100 * 4
    for loss in losses:
        loss.backward()
    assert counted.held == 0 and counted.peak == 3 * per_call


def test_counts_on_the_thread_that_calls_it():
    counted = CountedLoss(F.cross_entropy)
    logits = torch.randn(8, 50, requires_grad=True)
    out = []
    worker = threading.Thread(target=lambda: out.append(counted(logits, torch.zeros(8).long())))
    worker.start()
    worker.join()
    assert counted.held >= logits.numel() * 4      # the worker's saves counted
    out[0].backward()
    assert counted.held == 0


def test_without_grad_nothing_is_saved():
    counted = CountedLoss(F.cross_entropy)
    with torch.no_grad():
        counted(torch.randn(8, 50), torch.zeros(8).long())
    assert counted.peak == 0
