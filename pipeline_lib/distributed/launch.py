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
import os
import re
import signal
import subprocess
import sys
from typing import Sequence

import torch


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


def worker_device() -> torch.device:
    """Inside a torchrun worker: its own GPU (``cuda:LOCAL_RANK``, made the current one)
    when every worker on this machine can have one, else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() >= local_workers:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(backend: str) -> torch.device:
    """The device this rank computes and communicates on under ``backend``.

    Its GPU is pinned whatever the backend (`worker_device`): CUDA's current device is
    0 in every process until someone sets it, so without the pin every rank's "cuda"
    would be GPU 0, and NCCL would refuse the duplicate GPU or the ranks would share it.
    NCCL moves GPU tensors only, so it needs a GPU per worker; gloo moves CPU tensors.
    """
    device = worker_device()
    if backend != "nccl":
        return torch.device("cpu")
    if device.type != "cuda":
        raise RuntimeError(
            f"backend 'nccl' needs one GPU per worker on this machine: there are "
            f"{os.environ.get('LOCAL_WORLD_SIZE', 1)} workers and "
            f"{torch.cuda.device_count()} GPU(s); start fewer workers per machine "
            f"(--nproc_per_node), or use backend 'gloo' (the default without GPUs)")
    return device
