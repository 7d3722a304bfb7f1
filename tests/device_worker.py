"""One of the processes of `test_launch`'s device tests, on a machine faked to have 4
GPUs (or ``FAKE_GPUS``, each task seeing its ``CUDA_VISIBLE_DEVICES``): ``torch.cuda``
answers from this process's fake, and the process group asked for runs on gloo
underneath (there is no GPU), while the device choice runs as it would for the backend
asked for. Writes ``OUT/rank{RANK}.json``: the current GPU
when the process group was created, and the device `init_mesh` would compute on.

    python device_worker.py OUT nccl|default
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pipeline_lib.distributed import launch
from pipeline_lib.distributed.job import process_group

GPUS = int(os.environ.get("FAKE_GPUS", 4))   # per process: 1 with CUDA_VISIBLE_DEVICES per task


class FakeCuda:
    """The few ``torch.cuda`` calls the device choice makes, on a machine with ``GPUS``."""

    def __init__(self) -> None:
        self.current = 0   # CUDA's default in every fresh process

    def set_device(self, device: int | torch.device) -> None:
        index = torch.device("cuda", device).index if isinstance(device, int) else device.index
        assert 0 <= index < GPUS, f"no GPU {index}"
        self.current = index

    def properties(self, device: torch.device) -> SimpleNamespace:
        # CUDA_VISIBLE_DEVICES renumbers: the UUID is that of the physical GPU
        physical = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2,3").split(",")[device.index]
        return SimpleNamespace(name="Fake GPU", uuid=f"fake-{physical}")

    def install(self) -> None:
        torch.cuda.device_count = lambda: GPUS
        torch.cuda.is_available = lambda: True
        torch.cuda.set_device = self.set_device
        torch.cuda.current_device = lambda: self.current
        torch.cuda.get_device_properties = self.properties


def main() -> None:
    out, asked = Path(sys.argv[1]), sys.argv[2]
    cuda = FakeCuda()
    cuda.install()
    seen: dict[str, object] = {}
    real_init = dist.init_process_group

    def init_process_group(backend: str, **kwargs: object) -> None:
        seen["backend"], seen["gpu_at_init"] = backend, cuda.current
        real_init("gloo", **kwargs)

    dist.init_process_group = init_process_group
    with process_group(backend=None if asked == "default" else asked, timeout=60):
        seen["mesh_device"] = str(launch.rank_device(str(seen["backend"])))
        seen["gpu_in_block"] = cuda.current
    rank = os.environ["RANK"]
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
