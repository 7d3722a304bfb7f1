"""Running per-rank programs on threads, one thread per rank (device).

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

import threading
import time
from typing import Any, Callable, Hashable

import torch

from pipeline_lib.schedules import Action
from pipeline_lib.thread_state import ThreadState
from pipeline_lib.threaded.interrupts import interrupts_held, wait_until_set
from pipeline_lib.timeline import Event, Timeline


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


def run_programs(programs: list[list[Action]], devices: list[torch.device],
                 receive: Callable[[Action], Any], compute: Callable[[Action, Any], None],
                 mailbox: Mailbox, title: str = "") -> Timeline:
    """Run ``programs[r]`` on thread r: for each action, wait for its input with
    ``receive(action)``, then ``compute(action, input)`` (which also hands on the result).

    Returns the measured timeline (seconds since the start): an event spans the compute
    only, so waiting shows as idle time. On CUDA each action is synchronised before its
    end time is taken, so the timeline shows when the device really worked rather than
    when kernels were queued.
    """
    # grad mode, autocast, saved-tensor hooks, the intra-op thread count... are per
    # thread: each stage thread computes under the caller's (see `thread_state`)
    modes = ThreadState.capture()
    errors: list[tuple[int, Action | None, BaseException]] = []
    events: list[Event] = []
    # each thread sets its flag as the very last thing it does; the caller waits for
    # these, not for Thread.join (see `interrupts`)
    finished = [threading.Event() for _ in programs]
    t0 = time.perf_counter()

    def worker(rank: int) -> None:
        device = devices[rank]
        action = None
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with modes.applied():
                for action in programs[rank]:
                    mailbox.check()
                    received = receive(action)
                    start = time.perf_counter()
                    compute(action, received)
                    if device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
                    events.append(Event(rank, action, start - t0, time.perf_counter() - t0))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append((rank, action, exc))
            mailbox.close(exc)
        finally:
            finished[rank].set()

    threads = [threading.Thread(target=worker, args=(r,), name=f"pipeline-rank{r}",
                                daemon=True) for r in range(len(programs))]
    running: list[threading.Event] = []   # the flags of the threads that were started
    try:
        with interrupts_held():   # all threads start, or the caller knows which did
            for thread, flag in zip(threads, finished):
                thread.start()
                running.append(flag)
        for flag in running:
            flag.wait()
    except BaseException as exc:   # the caller was interrupted: stop the threads first
        try:
            mailbox.close(exc)
        finally:   # (even if a second Ctrl-C cut that short: then they run to the end)
            wait_until_set(running)
        raise
    if errors:
        # report the failure that caused the others (they only saw the abort)
        rank, action, exc = next((e for e in errors if not isinstance(e[2], PipelineAborted)),
                                 errors[0])
        exc.add_note(f"raised on pipeline rank {rank} ({devices[rank]}) while running "
                     f"action {action}")
        raise exc
    events.sort(key=lambda e: (e.start, e.rank))
    return Timeline(len(programs), events, unit="s", title=title)

