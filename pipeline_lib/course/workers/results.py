"""What a notebook's torchrun job leaves for the notebook: one file per rank,
``PREFIX{rank}.pt``, read back in rank order and never mixed with an earlier run's.

Two mistakes this prevents. Sorted as text, ``rank10`` comes before ``rank2``. And the
files an earlier run left (one with more ranks, or one that failed half-way) look just
like this run's. So every rank's file records the job's size, a new job (`clear`) and
every run (`start_run`) first remove the last run's files, and `load` checks that it
has exactly ranks 0 .. size - 1.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _files(folder: str | Path, prefix: str) -> dict[int, Path]:
    """``{rank: path}`` of the ``PREFIX{rank}.pt`` files in ``folder``."""
    found = {}
    for path in Path(folder).glob(f"{prefix}*.pt"):
        number = path.stem.removeprefix(prefix)
        if number.isdigit():
            found[int(number)] = path
    return found


def write_setup(folder: str | Path, prefix: str, setup: Any) -> Path:
    """Save a job's ``setup`` (a dataclass) as ``folder/setup.pt``, for every rank to
    read; an earlier run's ``PREFIX{rank}.pt`` files there are removed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    clear(folder, prefix)
    path = folder / "setup.pt"
    torch.save(asdict(setup), path)
    return path


def clear(folder: str | Path, prefix: str) -> None:
    """Remove the files of an earlier run."""
    for path in _files(folder, prefix).values():
        path.unlink()


def start_run(folder: str | Path, prefix: str) -> None:
    """Inside the job, before any rank saves: rank 0 removes the last run's files, so a
    run that fails half-way leaves too few files rather than a mix of two runs."""
    if dist.get_rank() == 0:
        clear(folder, prefix)
    dist.barrier()


def save(folder: str | Path, prefix: str, value: Any) -> None:
    """This rank's ``value`` (tensors, numbers, strings, lists and dicts of them)."""
    torch.save({"world_size": dist.get_world_size(), "value": value},
               Path(folder) / f"{prefix}{dist.get_rank()}.pt")


def load(folder: str | Path, prefix: str, command: str) -> list[Any]:
    """Every rank's value, in rank order. ``command`` is what makes the files, for the
    error when they are missing."""
    files = _files(folder, prefix)
    if not files:
        raise FileNotFoundError(f"no results in {folder}: run `{command}` first")
    saved = [torch.load(files[rank]) for rank in sorted(files)]
    size = saved[0]["world_size"]
    if sorted(files) != list(range(size)) or any(s["world_size"] != size for s in saved):
        raise FileNotFoundError(f"{folder} holds the files of ranks {sorted(files)}, not of "
                                f"ranks 0 to {size - 1} of one run: the last run did not "
                                f"finish. Check its output and run `{command}` again")
    return [s["value"] for s in saved]
