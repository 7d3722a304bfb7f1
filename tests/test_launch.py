"""`launch.torchrun` never outlives its deadline or its caller, and neither do its
workers: torchrun starts each in a session of its own, out of reach of a signal to
torchrun's process group.

Each test runs the launch in a child Python process (`DRIVER`), so that a launch that
hangs fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
