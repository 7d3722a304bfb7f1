"""Our schedules in PyTorch's pipeline runtime, and PyTorch's in ours.

* `notation`: PyTorch's action strings (``2F0``, ``1I3``, ``0SEND_F1``,
  ``(0F7;7B3)OVERLAP_F_B``) and schedule CSVs, both ways (`Schedule.to_pytorch`,
  `Schedule.to_csv`, `Schedule.from_csv` delegate here); plain text, no private API;
* `private`: the one module that imports ``torch.distributed.pipelining``'s private names
  (``_PipelineScheduleRuntime``, ``_Action``, ...), checked, with a clear error when a
  release moves them;
* `runner`: PyTorch ``PipelineStage`` objects cut from a model by our `partition`, and one
  step of an exported schedule on ``_PipelineScheduleRuntime``, in each process of a job.
"""
