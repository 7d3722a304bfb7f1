"""Executor 1, one process: every stage on its own thread (its own device), `Pipe`.

`pipe.Pipe` splits an ``nn.Sequential`` into stages; `threads.run_threads` starts one
thread per rank, each running the rank's program with `pipeline_lib.executor.run_program`
(the loop the multi-process executor runs too), its actions carried out by the stages'
`pipeline_lib.stage.StageRunner`s. Activations travel through a `threads.Mailbox`
(`threads.InProcess`, the in-process transport).
"""
from pipeline_lib.threaded.pipe import Pipe
from pipeline_lib.threaded.threads import InProcess, Mailbox, PipelineAborted, run_threads

__all__ = ["InProcess", "Mailbox", "Pipe", "PipelineAborted", "run_threads"]
