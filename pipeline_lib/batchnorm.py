"""BatchNorm whose running statistics see the mini-batch, not each micro-batch.

In training, BatchNorm normalises with the statistics of the batch it is given; under a
pipeline that is a micro-batch, as if the batch were smaller, and that stays so here. But
the running mean and variance (what evaluation uses) would be updated once per
micro-batch: m noisy small-batch updates per step instead of one, the momentum applied m
times. (Not once more for a checkpointed micro-batch: a replay puts every normalisation
layer's running statistics back as they were, see `checkpoint`.)
`DeferredBatchNorm` instead accumulates every micro-batch's statistics and folds them into
the running estimates once, after the mini-batch's last micro-batch, so they end up
exactly as a full-batch BatchNorm would leave them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline_lib.checkpoint import is_recomputing


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm for inputs split into ``chunks`` micro-batches.

    Each training forward counts as one micro-batch; after ``chunks`` of them, the running
    statistics take one step with the mean and unbiased variance of all their rows
    together. Pipe(..., deferred_batch_norm=True) makes these with `convert`.
    """

    def __init__(self, num_features: int, chunks: int, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True,
                         device=device, dtype=dtype)
        self.chunks = chunks
        # Per-channel mean and sum of squared deviations of the rows seen so far this
        # mini-batch, merged micro-batch by micro-batch (Chan et al.'s parallel variance:
        # no E[x²] - E[x]² cancellation). Not persistent: the state_dict stays BatchNorm's.
        self.register_buffer("seen_mean", torch.zeros_like(self.running_mean), persistent=False)
        self.register_buffer("seen_m2", torch.zeros_like(self.running_mean), persistent=False)
        self.seen_rows = self.seen_microbatches = 0

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"BatchNorm expects (batch, channels, ...) input, got a "
                             f"{input.dim()}-D tensor")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)        # normalise with the running statistics
        if not is_recomputing():                 # a replay must not count twice
            self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, training=True,
                            eps=self.eps)

    def _accumulate(self, input: Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        x = input.to(self.seen_mean.dtype)
        var, mean = torch.var_mean(x, dims, correction=0)
        rows = x.numel() // x.size(1)
        total = self.seen_rows + rows
        delta = mean - self.seen_mean
        self.seen_mean += delta * (rows / total)
        self.seen_m2 += var * rows + delta.square() * (self.seen_rows * rows / total)
        self.seen_rows, self.seen_microbatches = total, self.seen_microbatches + 1
        if self.seen_microbatches == self.chunks:
            self._commit()

    def _commit(self) -> None:
        """One running-statistics step, as nn.BatchNorm takes for a whole batch."""
        self.num_batches_tracked += 1
        if self.momentum is None:                # cumulative average over all batches
            factor = 1.0 / self.num_batches_tracked.item()
        else:
            factor = self.momentum
        unbiased_var = self.seen_m2 / (self.seen_rows - 1)
        self.running_mean.lerp_(self.seen_mean, factor)
        self.running_var.lerp_(unbiased_var, factor)
        self.forget_partial_batch()

    def forget_partial_batch(self) -> None:
        """Drop the micro-batches seen so far this mini-batch. A `Pipe` step that fails
        half-way calls it: otherwise the next step's first micro-batches would complete
        the failed one's, and every later commit would fall at the wrong boundary."""
        self.seen_mean.zero_()
        self.seen_m2.zero_()
        self.seen_rows = self.seen_microbatches = 0

    @classmethod
    def convert(cls, module: nn.Module, chunks: int) -> nn.Module:
        """Replace, in place, every BatchNorm in ``module`` that tracks running statistics
        by a DeferredBatchNorm sharing its parameters and buffers (so an optimizer built
        before still holds the right tensors). Returns ``module``, or its replacement if
        it is itself a BatchNorm.

        A DeferredBatchNorm already there is re-chunked in place: a model wrapped again
        with another ``chunks`` must commit after that many micro-batches, not the old
        number. What it had accumulated of an unfinished mini-batch is dropped."""
        if isinstance(module, cls):
            module.chunks = chunks
            module.forget_partial_batch()
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            if isinstance(module, nn.modules.lazy.LazyModuleMixin) \
                    and module.has_uninitialized_params():
                raise ValueError(f"{type(module).__name__} is not initialised yet; run one "
                                 f"forward before building the Pipe")
            deferred = cls(module.num_features, chunks, module.eps, module.momentum,
                           module.affine, device=module.running_mean.device,
                           dtype=module.running_mean.dtype)
            if module.affine:
                deferred.weight, deferred.bias = module.weight, module.bias
            deferred.running_mean, deferred.running_var = module.running_mean, module.running_var
            deferred.num_batches_tracked = module.num_batches_tracked
            deferred.train(module.training)
            return deferred
        for name, child in module.named_children():
            module.add_module(name, cls.convert(child, chunks))
        return module
