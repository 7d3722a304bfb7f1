"""Keep freed memory in the process, so that CPU training steps stop faulting it in again.

A training step allocates its activations, frees them during the backward, and allocates
the same sizes again in the next step. With glibc's defaults, the memory of those blocks
goes back to the kernel each time: blocks above the mmap threshold (128 KiB at first,
rising as such blocks are freed, never above 32 MiB) get a mapping of their own that
``free`` unmaps, and the heap's free top is trimmed. The next step touches fresh pages,
which the kernel faults in and zeroes one 4 KiB page at a time: 465 000 minor faults per
step of ``bench/bench_pipe.py``'s Transformer on one thread, about 10 000 per pipelined
step of it or of its MLP (``bench/README.md``). Stage threads also get arenas of their
own, whose extra heaps (64 MiB at most) are deleted once empty: a stage thread's 32 MiB
blocks were mapped afresh each step, 65 000 faults that the main thread did not pay. On
two cores, issue 15 measured an MLP pipeline of two stage threads at 68-70% of its ideal
speedup with glibc's defaults and 86% with the settings below.

`keep_freed_memory` raises the mmap and trim thresholds and the top pad (what the
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` variables
do; caching allocators such as jemalloc keep memory by design) and makes every thread
allocate from the main arena (``MALLOC_ARENA_MAX=1``): a step then faults a few dozen
times. Blocks of 32 MiB and more still get a mapping of their own where no free memory in
the heap holds them. The price: the process keeps its peak heap after training, and
threads share one arena's lock (stage threads allocate little between kernels).

The settings are process-wide and cannot be taken back: they hold for every thread and
every later allocation, also outside the pipeline. `Pipe` applies them when it has a CPU
stage (`for_stages`), once per process; opt out with ``Pipe(..., keep_freed_memory=False)``
in code, or ``PIPELINE_LIB_KEEP_FREED_MEMORY=0`` in the environment, for code you run but
do not edit (a script, a notebook), or to keep your own ``MALLOC_*`` settings, which these
would override. Only glibc (Linux) has them; elsewhere nothing changes.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Iterable

import torch

ENV_VAR = "PIPELINE_LIB_KEEP_FREED_MEMORY"

# mallopt's option numbers (malloc.h) and the values set
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20),   # glibc's largest: heap, not mmap, below 32 MiB
            (_M_TRIM_THRESHOLD, 1 << 30),    # keep up to 1 GiB of free heap top
            (_M_TOP_PAD, 512 << 20),         # grow the heap in large steps
            (_M_ARENA_MAX, 1))               # every thread allocates from the main arena

_applied: bool | None = None   # the first call's result; None: not tried in this process


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Apply the settings, once per process; later calls return the first call's result:
    True if glibc took every setting. Best called before threads allocate (`Pipe` calls it
    when it is built): a thread that already has an arena keeps it."""
    global _applied
    if _applied is None:
        mallopt = _mallopt()
        _applied = mallopt is not None and all(
            [mallopt(option, value) == 1 for option, value in SETTINGS])
    return _applied


def wanted() -> bool:
    """What ``PIPELINE_LIB_KEEP_FREED_MEMORY`` asks for: unset or ``1`` yes, ``0`` no."""
    value = os.environ.get(ENV_VAR, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 1 (keep freed memory, the default) or 0 (leave "
                         f"glibc's defaults), got {value!r}")
    return value == "1"


def in_force() -> bool:
    """Whether this process runs with the settings."""
    return bool(_applied)


def for_stages(devices: Iterable[torch.device | str], keep: bool = True) -> bool:
    """`keep_freed_memory` if a stage runs on the CPU and neither ``keep=False`` nor the
    environment opts out. Returns `in_force` after the call."""
    if keep and wanted() and any(torch.device(d).type == "cpu" for d in devices):
        keep_freed_memory()
    return in_force()
