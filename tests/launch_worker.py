"""Launch a test worker script with torchrun on this machine, never hanging the tests."""
from __future__ import annotations

import functools
import os
import tempfile
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_lib.distributed.launch import kill_job

REPO = Path(__file__).resolve().parent.parent


def torchrun_worker(script: str, nproc: int, *args: str, timeout: float = 240) -> str:
    """Run ``tests/script`` in ``nproc`` processes; its output, after asserting success."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), str(REPO / "tests" / script), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} {' '.join(args)} hung for {timeout} s:\n{kill_job(process)}")
    assert process.returncode == 0, output
    return output


@functools.cache
def clip_and_bf16_run() -> Path:
    """The folder of the one launch that the clipping and the bfloat16 tests share."""
    out = Path(tempfile.mkdtemp(prefix="clip-bf16-"))
    torchrun_worker("dist_train_worker.py", 4, "--scenario", "clip", "--out", str(out))
    return out
