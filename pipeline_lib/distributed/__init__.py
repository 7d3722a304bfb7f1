"""Executor 2, many processes: one pipeline rank per process on ``torch.distributed``.

* `pipe.DistributedPipe` runs the very `Schedule` objects the simulator draws, driving a
  `pipeline_lib.stage.StageRunner` per stage, with DDP across replicas;
* `p2p` moves the lowered schedule's messages between ranks: a header, then the tensors
  (`p2p.PointToPoint`), or, once shapes repeat, only the tensors into receives posted
  early (`p2p.PostedEarly`);
* `mesh` lays the processes out in a ``dp × pp`` grid, with a channel (a 2-rank group)
  per direction between the ranks that exchange messages;
* `job` joins the torchrun job (`job.process_group`) and, when one rank fails, makes
  every rank stop with that rank's reason;
* `launch` starts a ``torchrun`` job from Python under a deadline (it and all its workers
  are killed past it, or on Ctrl-C) and gives each worker its device.
"""
from pipeline_lib.distributed.launch import TorchrunError, backend_for, torchrun, worker_device
from pipeline_lib.distributed.job import process_group
from pipeline_lib.distributed.mesh import Mesh, init_mesh
from pipeline_lib.distributed.pipe import DistributedPipe

__all__ = ["DistributedPipe", "Mesh", "TorchrunError", "backend_for", "init_mesh",
           "process_group", "torchrun", "worker_device"]
