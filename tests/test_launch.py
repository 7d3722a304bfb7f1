"""`launch.torchrun` never outlives its deadline or its caller, and neither do its
workers: torchrun starts each in a session of its own, out of reach of a signal to
torchrun's process group.

Each test runs the launch in a child Python process (`DRIVER`), so that a launch that
hangs fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
WORKERS = 2
DRIVER = """
import sys
from pipeline_lib.distributed.launch import TorchrunError, torchrun
try:
    torchrun("hang_worker", [sys.argv[1]], nproc=%d, timeout=float(sys.argv[2]))
except TorchrunError as error:
    print(error)
""" % WORKERS


def start_driver(folder: Path, timeout: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(folder), str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed but not yet reaped, is not)."""
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                           text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def worker_pids(folder: Path, wait: float = 0.0) -> list[int]:
    deadline = time.monotonic() + wait
    while len(list(folder.glob("*.pid"))) < WORKERS and time.monotonic() < deadline:
        time.sleep(0.2)
    return [int(path.stem) for path in folder.glob("*.pid")]


@pytest.fixture
def folder(tmp_path):
    """Where the workers leave their process ids; any still running at the end (the
    launcher did not stop them) are killed, by id."""
    yield tmp_path
    for pid in worker_pids(tmp_path):
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.alone
def test_deadline_stops_torchrun_and_every_worker(folder):
    timeout = 20.0   # long enough for torchrun to start the workers on a busy machine
    start = time.monotonic()
    driver = start_driver(folder, timeout)
    try:
        output, _ = driver.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        driver.kill()
        pytest.fail("torchrun(..., timeout=20) was still waiting 60 s past its deadline")
    seconds = time.monotonic() - start
    assert f"did not finish within {timeout:g} s and was killed with all its workers" in output
    assert seconds < timeout + 15
    pids = worker_pids(folder)
    assert len(pids) == WORKERS, output
    assert not [pid for pid in pids if running(pid)]


@pytest.mark.alone
def test_interrupt_stops_torchrun_and_every_worker(folder):
    driver = start_driver(folder, timeout=300)
    pids = worker_pids(folder, wait=60)
    assert len(pids) == WORKERS
    driver.send_signal(signal.SIGINT)          # Ctrl-C, or a notebook's stop button
    try:
        output, _ = driver.communicate(timeout=30)   # the run alone would last 300 s
    except subprocess.TimeoutExpired:
        driver.kill()
        pytest.fail("torchrun(...) was still running 30 s after Ctrl-C")
    assert "KeyboardInterrupt" in output
    assert not [pid for pid in pids if running(pid)]


def start_ranks(out: Path, backend: str, ranks: int = 4,
                each: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """``ranks`` processes of one job on this machine, with the environment torchrun gives
    its workers (no torchrun agent: it would add nothing here but start-up time), and
    ``each`` (``{VARIABLE: "value for rank 0,value for rank 1,..."}``) set per rank."""
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    job = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
           "MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    per_rank = {name: values.split(",") for name, values in (each or {}).items()}
    return [subprocess.Popen([sys.executable, str(REPO / "tests" / "device_worker.py"),
                              str(out), backend],
                             env={**os.environ, **job, "RANK": str(r), "LOCAL_RANK": str(r),
                                  **{name: values[r] for name, values in per_rank.items()}},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(ranks)]


def finish(ranks: list[subprocess.Popen]) -> list[str]:
    outputs = []
    for process in ranks:
        try:
            outputs.append(process.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            pytest.fail("the ranks did not finish within 120 s")
    return outputs


@pytest.mark.parametrize("backend", ["nccl", "default"])
def test_every_rank_pins_its_own_gpu(tmp_path, backend):
    """On a machine with a GPU per worker (faked), every rank's GPU is cuda:LOCAL_RANK
    before the process group exists, whether NCCL was asked for or chosen: otherwise
    every rank's current device is GPU 0, and NCCL refuses the duplicate GPU. Rank 0
    says where each rank computes."""
    ranks = start_ranks(tmp_path, backend)
    outputs = finish(ranks)
    assert all(p.returncode == 0 for p in ranks), "\n".join(outputs)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(ranks))]
    for r, rank in enumerate(seen):
        assert rank == {"backend": "nccl", "gpu_at_init": r, "mesh_device": f"cuda:{r}",
                        "gpu_in_block": r}, f"rank {r}"
        assert re.search(rf"^rank {r} on .*\(local rank {r}\): nccl on cuda:{r} \(Fake GPU, "
                         rf"GPU-fake-{r}\): GPU {r} of the 4", outputs[0], re.MULTILINE)
    assert not any("rank 0 on" in output for output in outputs[1:])


def test_a_task_that_sees_one_gpu_uses_it_and_tasks_sharing_one_stop(tmp_path):
    """One GPU visible per task (CUDA_VISIBLE_DEVICES set per task, as SLURM does): each
    rank computes on its cuda:0 over NCCL, where the ranks used to fall back to the CPU
    without a word. Two tasks shown the same GPU stop before NCCL would, naming it."""
    ranks = start_ranks(tmp_path, "default", 2, {"FAKE_GPUS": "1,1",
                                                 "CUDA_VISIBLE_DEVICES": "3,1"})
    outputs = finish(ranks)
    assert all(p.returncode == 0 for p in ranks), "\n".join(outputs)
    for r, physical in enumerate((3, 1)):
        rank = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rank["backend"] == "nccl" and rank["mesh_device"] == "cuda:0"
        assert (f"nccl on cuda:0 (Fake GPU, GPU-fake-{physical}): its task's one GPU "
                f"(CUDA_VISIBLE_DEVICES={physical})") in outputs[0]
    ranks = start_ranks(tmp_path, "default", 2, {"FAKE_GPUS": "1,1",
                                                 "CUDA_VISIBLE_DEVICES": "2,2"})
    outputs = finish(ranks)
    assert all(p.returncode != 0 for p in ranks)
    assert all("ranks share a GPU: ranks [0, 1] all compute on GPU-fake-2" in output
               for output in outputs)


def test_nccl_without_a_gpu_per_worker_is_refused_with_the_fix(monkeypatch):
    from pipeline_lib.distributed.launch import rank_device

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="4 workers on this machine and 2 GPU.*"
                                           "--nproc_per_node 2"):
        rank_device("nccl")
    assert rank_device("gloo") == torch.device("cpu")


CPU = torch.device("cpu")


@pytest.mark.parametrize("rank, workers, gpus, visible, want, device, why", [
    (1, 2, 4, None, "auto", "cuda:1", "GPU 1 of the 4"),
    (1, 2, 4, None, "cpu", "cpu", "the CPU was asked for"),
    (1, 2, 1, "5", "auto", "cuda:0", "its task's one GPU (CUDA_VISIBLE_DEVICES=5)"),
    (1, 2, 1, "5", "cuda", "cuda:0", "its task's one GPU"),
    (0, 1, 0, None, "auto", "cpu", "no GPU (CUDA_VISIBLE_DEVICES unset)"),
    (1, 4, 2, None, "auto", "cpu", "on the CPU because 4 workers on this machine and 2 "
                                   "GPU(s) visible to each (CUDA_VISIBLE_DEVICES unset); "
                                   "set PIPELINE_LIB_DEVICE=cuda to stop instead"),
    (1, 2, 1, None, "auto", "cpu", "on the CPU because 2 workers"),
])
def test_each_worker_gets_its_own_gpu_or_says_why_not(rank, workers, gpus, visible, want,
                                                      device, why):
    from pipeline_lib.distributed.launch import choose_device

    placement = choose_device(rank, workers, gpus, visible, want)
    assert placement.device == torch.device(device) and why in placement.why


@pytest.mark.parametrize("rank, workers, gpus, visible", [
    (1, 2, 1, None), (0, 2, 0, None), (0, 1, 0, ""), (2, 4, 2, "0,1")])
def test_gpus_asked_for_and_missing_stop_with_why(rank, workers, gpus, visible):
    from pipeline_lib.distributed.launch import choose_device

    with pytest.raises(RuntimeError, match=rf"GPUs were asked for .*{workers} workers on this "
                                           rf"machine and {gpus} GPU\(s\).*a GPU of its own"):
        choose_device(rank, workers, gpus, visible, "cuda")
    with pytest.raises(ValueError, match="PIPELINE_LIB_DEVICE='gpu'"):
        choose_device(rank, workers, gpus, visible, "gpu")
