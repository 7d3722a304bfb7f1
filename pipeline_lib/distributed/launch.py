"""Start a torchrun job from Python (a notebook, a test) and never hang doing it; inside
the job, give each worker its device.

A distributed job that waits on a collective which never comes waits forever, and so
would the notebook cell that started it. So the job runs in its own process group
(session) under a deadline: past it, torchrun *and every worker it started* are killed
and the caller gets an error carrying the job's output so far, which says where it hung.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Sequence

import torch


class TorchrunError(RuntimeError):
    """A torchrun job failed or ran past its deadline; the message ends with its output."""


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


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
        raise TorchrunError(f"`{shown}` did not finish within {timeout:g} s and was killed "
                            f"with all its workers (a rank waiting for a message that "
                            f"never comes?). Its last output:\n{_tail(_kill(process))}"
                            ) from None
    except BaseException:   # an interrupted caller must not leave the job running
        _kill(process)
        raise
    if process.returncode != 0:
        raise TorchrunError(f"`{shown}` exited with code {process.returncode}. "
                            f"Its last output:\n{_tail(output)}")
    return output


def _kill(process: subprocess.Popen) -> str:
    """Kill torchrun and its workers (its whole session); return what they printed."""
    os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate()
    return output


def worker_device() -> torch.device:
    """Inside a torchrun worker: its own GPU when every worker on this machine can have
    one, else the CPU. Pair it with the matching backend: NCCL for GPUs, gloo for CPUs."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() >= local_workers:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
