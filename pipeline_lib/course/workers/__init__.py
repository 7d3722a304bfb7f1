"""Code that exists for one notebook's ``torchrun`` workers, kept importable because a
worker process cannot run a function defined inside a notebook.

* `ddp_pipeline`: notebook 05, a pipeline replicated with DistributedDataParallel;
* `torch_pipelining`: notebook 06, the same model on ``torch.distributed.pipelining``;
* `three_dimensions`: notebook 08, a block split by hand and by PyTorch's plan, and a stage
  replicated with DDP and sharded with FSDP;
* `data_parallel`: notebook 04, a DistributedDataParallel worker (the one-process
  primitives are `pipeline_lib.course.data_parallel`).
"""
