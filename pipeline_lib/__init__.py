"""pipeline_lib: pipeline parallelism you can read, run on a laptop, and scale to GPUs."""
from .batchnorm import DeferredBatchNorm
from .checkpoint import is_checkpointing, is_recomputing
from .devices import WithDevice
from .microbatch import NoChunk
from .pipe import Pipe
from .schedules import Action, Schedule, ScheduleError, validate
from .skip import Namespace, SkipError, pop, skippable, stash, verify_skips
from .threaded import PipelineAborted
from .timeline import Event, Timeline, bubble_theory, simulate

__all__ = [
    "Action", "DeferredBatchNorm", "Event", "Namespace", "NoChunk", "Pipe",
    "PipelineAborted", "Schedule", "ScheduleError", "SkipError", "Timeline", "WithDevice",
    "bubble_theory", "is_checkpointing", "is_recomputing", "pop", "simulate", "skippable",
    "stash", "validate", "verify_skips",
]
