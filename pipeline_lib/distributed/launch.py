"""Start a torchrun job from Python (a notebook, a test) and never hang doing it; inside
the job, give each worker its device.

A distributed job that waits on a collective which never comes waits forever, and so
would the notebook cell that started it. So the job runs under a deadline: past it, or
when the caller is interrupted (Ctrl-C, a notebook's stop button), torchrun *and every
worker it started* are killed, and the caller gets an error carrying the job's output so
far, which says where it hung.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist


class TorchrunError(RuntimeError):
    """A torchrun job failed or ran past its deadline; the message ends with its output."""


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _reasons(output: str) -> str:
    """The lines where ranks said why they stopped (`job.process_group` prints them)."""
    said = re.findall(r"^(?:rank \d+ (?:failed|lost)|rank \d+: stopping|a rank was lost).*$",
                      output, flags=re.MULTILINE)
    return "".join(f"\n  {line}" for line in dict.fromkeys(said))


def torchrun(module: str, args: Sequence[str] = (), nproc: int = 2,
             timeout: float = 120.0) -> str:
    """Run ``torchrun --standalone --nproc-per-node nproc -m module *args``; return its
    output (stdout and stderr together).

    ``--standalone`` picks a free port, so jobs started side by side do not collide.
    Each worker gets one OpenMP thread: ``nproc`` workers share the machine's cores.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", module, *map(str, args)]
    shown = "torchrun " + " ".join(command[3:])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = kill_job(process)
        raise TorchrunError(f"`{shown}` did not finish within {timeout:g} s and was killed "
                            f"with all its workers (a rank waiting for a message that never "
                            f"comes?){_reasons(output)}\nIts last output:\n{_tail(output)}"
                            ) from None
    except BaseException:   # an interrupted caller must not leave the job running
        kill_job(process)
        raise
    if process.returncode != 0:
        raise TorchrunError(f"`{shown}` exited with code {process.returncode}"
                            f"{_reasons(output)}\nIts last output:\n{_tail(output)}")
    return output


def kill_job(process: subprocess.Popen) -> str:
    """Kill torchrun (``process``) and every process it started; return their output.

    torchrun starts each worker in a session of its own, so killing torchrun's process
    group would leave the workers running, and holding the output pipe open. So torchrun
    is frozen first (it starts no more), its descendants are found by their parent ids,
    and all are killed.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGSTOP)
    for pid in _descendants(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate()
    return output


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children, ...), as ``ps`` lists them
    on Linux and macOS alike."""
    table = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True,
                           text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


DEVICE_CHOICE = "PIPELINE_LIB_DEVICE"   # "cuda": stop unless each worker has a GPU; "cpu"


@dataclass(frozen=True)
class Placement:
    """Where a worker computes, and why there: what each rank says at start."""

    device: torch.device
    why: str


def choose_device(local_rank: int, local_workers: int, gpus: int, visible: str | None,
                  want: str = "auto") -> Placement:
    """Where worker ``local_rank`` of ``local_workers`` on this machine computes, given
    the ``gpus`` it sees (``CUDA_VISIBLE_DEVICES`` = ``visible``, None if unset) and
    what was asked: ``"cuda"`` (backend NCCL, or ``PIPELINE_LIB_DEVICE=cuda``), ``"cpu"``,
    or ``"auto"``.

    A GPU per worker: ``cuda:LOCAL_RANK``. One GPU visible and ``CUDA_VISIBLE_DEVICES``
    set: that GPU is this task's own (SLURM's ``--gpus-per-task=1`` and most clusters
    give each task its own this way; `check_own_gpus` catches tasks that share it).
    Fewer GPUs than workers otherwise: with GPUs asked for, an error that says why and
    what to change; else the CPU, saying why (never silently)."""
    if want not in ("auto", "cuda", "cpu"):
        raise ValueError(f"{DEVICE_CHOICE}={want!r}: give 'cuda' (a GPU per worker, or "
                         f"stop), 'cpu', or leave it unset")
    if want == "cpu":
        return Placement(torch.device("cpu"), f"the CPU was asked for (backend 'gloo' or "
                                              f"{DEVICE_CHOICE}=cpu)")
    shown = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else \
        "CUDA_VISIBLE_DEVICES unset"
    if gpus >= local_workers and local_rank < gpus:
        return Placement(torch.device("cuda", local_rank),
                         f"GPU {local_rank} of the {gpus} this machine's workers share")
    if gpus == 1 and visible:
        return Placement(torch.device("cuda", 0), f"its task's one GPU ({shown})")
    why = (f"{local_workers} workers on this machine and {gpus} GPU(s) visible to each "
           f"({shown})")
    if want == "cuda":
        raise RuntimeError(
            f"GPUs were asked for (backend 'nccl' or {DEVICE_CHOICE}=cuda), but {why}: "
            f"each worker needs a GPU of its own. Start at most {gpus} worker(s) per "
            f"machine (--nproc_per_node {max(gpus, 1)}), give each task its own GPU "
            f"(CUDA_VISIBLE_DEVICES per task, e.g. srun --gpus-per-task=1), or run on "
            f"CPUs (backend 'gloo', {DEVICE_CHOICE}=cpu)")
    if gpus == 0:
        return Placement(torch.device("cpu"), f"no GPU ({shown})")
    return Placement(torch.device("cpu"), f"on the CPU because {why}; set "
                     f"{DEVICE_CHOICE}=cuda to stop instead")


def worker_placement(want: str | None = None) -> Placement:
    """`choose_device` for this torchrun worker (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``PIPELINE_LIB_DEVICE`` unless ``want`` says), its GPU made the current one: CUDA's
    current device is 0 in every process until someone sets it, so without that every
    rank's "cuda" would be GPU 0."""
    placement = choose_device(int(os.environ.get("LOCAL_RANK", 0)),
                              int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                              torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                              want or os.environ.get(DEVICE_CHOICE, "auto"))
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    return placement


def worker_device() -> torch.device:
    """Inside a torchrun worker: its own GPU, made the current one, when it can have one,
    else the CPU (`worker_placement` says why)."""
    return worker_placement().device


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(backend: str) -> torch.device:
    """The device this rank computes and communicates on under ``backend``: NCCL moves
    GPU tensors only, so it needs a GPU per worker (or stops, saying why); gloo moves
    CPU tensors."""
    if backend != "nccl":
        return torch.device("cpu")
    return worker_placement("cuda").device


def gpu_id(device: torch.device) -> str:
    """What tells one GPU from another across processes: its UUID (``CUDA_VISIBLE_DEVICES``
    renumbers GPUs in each process)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else f"{socket.gethostname()} GPU {device.index}"


def announce(store: Any, rank: int, world_size: int, backend: str, placement: Placement,
             timeout: float) -> None:
    """Once, at the start of a job: every rank publishes where it computes and why in
    the c10d ``store``; rank 0 prints one line per rank; every rank refuses GPUs shared by
    ranks, which NCCL would refuse at its first collective ("Duplicate GPU detected")
    without saying what to change."""
    device = placement.device
    gpu = gpu_id(device) if device.type == "cuda" else None
    where = f"{device} ({torch.cuda.get_device_properties(device).name}, {gpu})" if gpu \
        else str(device)
    line = (f"rank {rank} on {socket.gethostname()} (local rank "
            f"{os.environ.get('LOCAL_RANK', 0)}): {backend} on {where}: {placement.why}")
    board = dist.PrefixStore("pipeline_lib/placement/", store)
    board.set(f"rank{rank}", json.dumps({"line": line, "gpu": gpu}))
    keys = [f"rank{r}" for r in range(world_size)]
    board.wait(keys, timedelta(seconds=timeout))
    ranks = [json.loads(board.get(key)) for key in keys]
    if rank == 0:
        print("\n".join(r["line"] for r in ranks), flush=True)
    check_own_gpus([r["gpu"] for r in ranks])


def check_own_gpus(gpus: Sequence[str | None]) -> None:
    """Refuse a GPU that several ranks compute on (``gpus[r]``: rank r's `gpu_id`, None
    on the CPU)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, gpu in enumerate(gpus):
        if gpu is not None:
            ranks_of.setdefault(gpu, []).append(rank)
    shared = {gpu: ranks for gpu, ranks in ranks_of.items() if len(ranks) > 1}
    if shared:
        said = "; ".join(f"ranks {ranks} all compute on {gpu}" for gpu, ranks in shared.items())
        raise RuntimeError(f"ranks share a GPU: {said}. Each rank needs a GPU of its own: "
                           f"give each task a different one (CUDA_VISIBLE_DEVICES per task), "
                           f"start fewer workers per machine, or run on CPUs "
                           f"({DEVICE_CHOICE}=cpu)")
