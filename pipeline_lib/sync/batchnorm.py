"""``torch.distributed.pipeline.sync.batchnorm``: `DeferredBatchNorm` with its classic
constructor and ``convert_deferred_batch_norm``.

The layer is `pipeline_lib.batchnorm.DeferredBatchNorm` (running statistics updated once
per mini-batch); only the calling conventions are the classic ones: ``chunks`` is the last
constructor argument, and converting a `DeferredBatchNorm` made for another ``chunks``
returns a new one sharing its parameters and running statistics, where
`pipeline_lib.batchnorm.DeferredBatchNorm.convert` re-chunks it in place. So a model
wrapped again with other ``chunks`` leaves the first `Pipe`'s layers as they were.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline_lib import batchnorm


class DeferredBatchNorm(batchnorm.DeferredBatchNorm):
    """`pipeline_lib.batchnorm.DeferredBatchNorm`, built as the classic one was:
    ``DeferredBatchNorm(num_features, eps, momentum, affine, chunks)``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, chunks: int = 1, *, device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(num_features, chunks, eps, momentum, affine, device=device,
                         dtype=dtype)

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Replace every BatchNorm in ``module`` that tracks running statistics by a
        `DeferredBatchNorm` sharing its parameters and running statistics; returns
        ``module`` (changed in place) or, if it is itself a BatchNorm, its replacement.

        A `DeferredBatchNorm` with these ``chunks`` is kept; one with other ``chunks`` is
        replaced like any BatchNorm, as the classic function did (its test
        ``test_convert_deferred_batch_norm``: ``dbn is not dbn_again``)."""
        if isinstance(module, batchnorm.DeferredBatchNorm) and module.chunks == chunks:
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine,
                           chunks, device=module.running_mean.device,
                           dtype=module.running_mean.dtype)
            if module.affine:
                deferred.weight, deferred.bias = module.weight, module.bias
            deferred.running_mean, deferred.running_var = module.running_mean, module.running_var
            deferred.num_batches_tracked = module.num_batches_tracked
            return deferred.train(module.training)
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
