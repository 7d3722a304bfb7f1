"""Running per-rank programs on threads, one thread per rank (device), and the in-process
transport between them.

Threads are enough for real parallelism: PyTorch releases the GIL inside its kernels, so
two stage threads on two CPU cores (or two GPUs) compute at the same time. Activations and
gradients travel through a `Mailbox`; a thread that needs one waits for it. If any thread
raises, the mailbox is closed, every waiting thread wakes up and stops, and the caller
gets the original exception: no hang. If the caller itself is interrupted (Ctrl-C in a
notebook), the mailbox is closed too and the caller waits for every thread to finish
its current action and stop before it re-raises: no stage thread is left running, adding
gradients behind the next step's back (`interrupts` says how, and why not
``Thread.join``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable

import torch

from pipeline_lib.devices import transfer
from pipeline_lib.lowering import Message, Receive
from pipeline_lib.thread_state import ThreadState
from pipeline_lib.interrupts import interrupts_held, wait_until_set


class PipelineAborted(RuntimeError):
    """Raised in a worker that was waiting when another worker failed."""


class Mailbox:
    def __init__(self) -> None:
        self._items: dict[Hashable, Any] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def put(self, key: Hashable, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: Hashable) -> Any:
        with self._cond:
            while True:
                self.check()
                if key in self._items:
                    return self._items.pop(key)
                self._cond.wait()

    def check(self) -> None:
        """Raise `PipelineAborted` once the pipeline has failed: stop, whatever is next."""
        if self._error is not None:
            raise PipelineAborted(f"the pipeline stopped: {type(self._error).__name__}")

    def close(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()


class InProcess:
    """The in-process `executor.Transport` of one stage thread: every message goes
    through the `Mailbox` shared by the threads, keyed by its `lowering.Message`, moved to
    the device of the stage that consumes it (a skip tensor straight from the stage that
    stashed it to the one that pops it, and its gradient straight back)."""

    def __init__(self, mailbox: Mailbox, devices: list[torch.device], rank: int,
                 device: torch.device):
        self.mailbox, self.devices = mailbox, devices
        self.where = f"pipeline rank {rank} ({device})"
        self.check = mailbox.check

    def receive(self, peer: int, message: Message) -> Any:
        return self.mailbox.get(message)

    def send(self, peer: int, message: Message, value: Any) -> None:
        self.mailbox.put(message, transfer(value, self.devices[message.stage]))

    def input_note(self, receive: Receive, value: Any) -> None:
        """Nothing to add: the input was made in this process, by the previous stage."""


def run_threads(devices: list[torch.device], work: Callable[[int], None],
                mailbox: Mailbox) -> None:
    """Run ``work(r)`` on thread r, one per entry of ``devices``, under the caller's
    modes, and return once every thread has stopped. If one raises, the mailbox is
    closed (every waiting thread stops) and the caller gets the failure that caused
    the others; if the caller is interrupted, the same, after the threads stopped.

    A single rank runs on the caller's thread: nothing runs beside it, so a thread would
    only add its start and hand-overs to the step (`bench/bench_overhead.py`)."""
    if len(devices) == 1:
        with torch.cuda.device(devices[0]) if devices[0].type == "cuda" \
                else contextlib.nullcontext():
            work(0)
        return
    # grad mode, autocast, saved-tensor hooks, the intra-op thread count... are per
    # thread: each stage thread computes under the caller's (see `thread_state`)
    modes = ThreadState.capture()
    errors: list[BaseException] = []
    # each thread sets its flag as the very last thing it does; the caller waits for
    # these, not for Thread.join (see `interrupts`)
    finished = [threading.Event() for _ in devices]

    def worker(rank: int) -> None:
        try:
            if devices[rank].type == "cuda":
                torch.cuda.set_device(devices[rank])
            with modes.applied():
                work(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            mailbox.close(exc)
        finally:
            finished[rank].set()

    threads = [threading.Thread(target=worker, args=(r,), name=f"pipeline-rank{r}",
                                daemon=True) for r in range(len(devices))]
    running: list[threading.Event] = []   # the flags of the threads that were started
    try:
        with interrupts_held():   # all threads start, or the caller knows which did
            for thread, flag in zip(threads, finished):
                thread.start()
                running.append(flag)
        for flag in running:
            flag.wait()
        # Their work is done; joining lets each thread finish exiting, so that none is
        # still winding down when the interpreter exits after the step (a daemon thread
        # caught there aborts the process).
        for thread in threads[:len(running)]:
            thread.join()
    except BaseException as exc:   # the caller was interrupted: stop the threads first
        try:
            mailbox.close(exc)
        finally:   # (even if a second Ctrl-C cut that short: then they run to the end)
            wait_until_set(running)
        raise
    if errors:   # the failure that caused the others (they only saw the abort)
        raise next((e for e in errors if not isinstance(e, PipelineAborted)), errors[0])
