"""`launch.torchrun` never outlives its deadline or its caller, and neither do its
workers: torchrun starts each in a session of its own, out of reach of a signal to
torchrun's process group.

Each test runs the launch in a child Python process (`DRIVER`), so that a launch that
hangs fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import os
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


def test_interrupt_stops_torchrun_and_every_worker(folder):
    driver = start_driver(folder, timeout=300)
    pids = worker_pids(folder, wait=60)
    assert len(pids) == WORKERS
    driver.send_signal(signal.SIGINT)          # Ctrl-C, or a notebook's stop button
    try:
        output, _ = driver.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        driver.kill()
        pytest.fail("torchrun(...) was still running 15 s after Ctrl-C")
    assert "KeyboardInterrupt" in output
    assert not [pid for pid in pids if running(pid)]


def start_ranks(out: Path, backend: str, ranks: int = 4) -> list[subprocess.Popen]:
    """``ranks`` processes of one job on this machine, with the environment torchrun gives
    its workers (no torchrun agent: it would add nothing here but start-up time)."""
    with socket.socket() as free:
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    job = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
           "MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    return [subprocess.Popen([sys.executable, str(REPO / "tests" / "device_worker.py"),
                              str(out), backend],
                             env={**os.environ, **job, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(ranks)]


@pytest.mark.parametrize("backend", ["nccl", "default"])
def test_every_rank_pins_its_own_gpu(tmp_path, backend):
    """On a machine with a GPU per worker (faked), every rank's GPU is cuda:LOCAL_RANK
    before the process group exists, whether NCCL was asked for or chosen: otherwise
    every rank's current device is GPU 0, and NCCL refuses the duplicate GPU."""
    ranks = start_ranks(tmp_path, backend)
    outputs = []
    for process in ranks:
        try:
            outputs.append(process.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            pytest.fail("the ranks did not finish within 120 s")
    assert all(p.returncode == 0 for p in ranks), "\n".join(outputs)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(ranks))]
    for r, rank in enumerate(seen):
        assert rank == {"backend": "nccl", "gpu_at_init": r, "mesh_device": f"cuda:{r}",
                        "gpu_in_block": r}, f"rank {r}"


def test_nccl_without_a_gpu_per_worker_is_refused_with_the_fix(monkeypatch):
    from pipeline_lib.distributed.launch import rank_device

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="4 workers and 2 GPU.*--nproc_per_node"):
        rank_device("nccl")
    assert rank_device("gloo") == torch.device("cpu")
