"""The `NotebookClient` the tests run notebooks with: nbclient's, minus its imitation of a
frontend's Output widget, which can make a cell wait out the whole timeout.

Why: ipywidgets' ``interact`` (notebooks 02 and 07) shows its function's output in an
``Output`` widget. nbclient imitates the frontend's side of that widget (its
``OutputWidget``): for each output the kernel sends into it, it sends a ``comm_msg``
back to the kernel on the shell socket, while the same socket is being polled, through
``zmq.asyncio``, for the cell's ``execute_reply``. That ``comm_msg`` goes out through
``jupyter_client``'s ``Session.send``, which sends on a plain ``zmq.Socket`` shadow of the
asyncio socket; so ``zmq.asyncio`` never hears of the send, yet the send processes the
socket's pending commands, and with them the edge-triggered wake-up that said the reply
had arrived. The reply then sits in the socket, unread, until the poll's timeout, when a
last non-blocking poll finds it and the cell "succeeds": a cell the kernel ran in 0.3 s
took exactly the timeout (300 s in the exercise test; with no timeout, as in ``jupyter
nbconvert --execute`` by default, forever). It happens when the reply arrives while the
client is still working through the widget's outputs, so on a busy machine, or at once
with many outputs. Upstream: jupyter/nbclient#312 (the symptom; open), jupyter/nbclient#311
(an unmerged attempt), jupyter/nbconvert#2029 (``interact`` "deadlocks" nbconvert).

Without the imitation nothing is sent on the shell socket while a cell runs, and the
Output widget's outputs stay in the cell's own outputs, where they came from (the kernel
sends them with the cell's request as their parent; only a frontend moves them into the
widget). So an error raised in an ``interact`` callback is an error output of its cell,
which the exercise test then sees, rather than widget state it never looks at.
"""
from __future__ import annotations

import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def notebook_client(nb: nbformat.NotebookNode, folder: Path, timeout: int,
                    allow_errors: bool = False) -> NotebookClient:
    """A client that runs ``nb`` in a fresh ``python3`` kernel started in ``folder`` (so
    that the notebook's relative paths hold), giving each cell ``timeout`` seconds."""
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            allow_errors=allow_errors,
                            resources={"metadata": {"path": str(folder)}})
    client.widget_registry = {}   # no imitated Output widget (see the module docstring)
    return client


def execute_timed(client: NotebookClient) -> dict[int, float]:
    """Execute ``client``'s notebook; return how long the client waited for each cell,
    from sending it to having its reply and outputs, by cell index."""
    started: dict[int, float] = {}
    waited: dict[int, float] = {}
    client.on_cell_execute = lambda cell, cell_index, **_: started.update(
        {cell_index: time.monotonic()})
    client.on_cell_executed = lambda cell, cell_index, **_: waited.update(
        {cell_index: time.monotonic() - started[cell_index]})
    client.execute()
    return waited
