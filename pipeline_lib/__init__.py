"""pipeline_lib: pipeline parallelism you can read, run on a laptop, and scale to GPUs."""
from .checkpoint import is_checkpointing, is_recomputing
from .microbatch import NoChunk
from .pipe import Pipe
from .schedules import Action, Schedule, ScheduleError, validate
from .threaded import PipelineAborted
from .timeline import Event, Timeline, bubble_theory, simulate

__all__ = [
    "Action", "Event", "NoChunk", "Pipe", "PipelineAborted", "Schedule", "ScheduleError",
    "Timeline", "bubble_theory", "is_checkpointing", "is_recomputing", "simulate",
    "validate",
]
