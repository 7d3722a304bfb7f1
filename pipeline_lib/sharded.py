"""Whether a tensor is a `DTensor`, or a module FSDP's: checks that import neither.

Why: importing ``torch.distributed.tensor`` (and with it FSDP's ``fully_shard``) costs
about a second of CPU per process: it loads sympy and DTensor's operator tables. Every
torchrun worker, notebook kernel and test process imports pipeline_lib, and most never
split a tensor. Nothing can be a DTensor, or an FSDP module, before its module has been
imported, so each check looks only once that module is loaded; the code that does split
tensors imports what it needs where it runs.
"""
from __future__ import annotations

import sys


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a `torch.distributed.tensor.DTensor`."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_fsdp_module(value: object) -> bool:
    """Whether ``value`` is a module that ``fully_shard`` (or FSDP's ``replicate``) wrapped."""
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(value, module.FSDPModule)
