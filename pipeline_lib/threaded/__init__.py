"""Executor 1, one process: every stage on its own thread (its own device), `Pipe`.

`pipe.Pipe` splits an ``nn.Sequential`` into stages and runs a `Schedule` by handing
each rank's action list to `threads.run_programs`, which drives one thread per rank;
each action is carried out by the stage's `pipeline_lib.stage.StageRunner`, the same
runner the multi-process executor uses. Activations travel through a `threads.Mailbox`.
"""
from pipeline_lib.threaded.pipe import Pipe
from pipeline_lib.threaded.threads import Mailbox, PipelineAborted, run_programs

__all__ = ["Mailbox", "Pipe", "PipelineAborted", "run_programs"]
