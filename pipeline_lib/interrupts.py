"""Ctrl-C and stage threads: hold an interrupt across the few lines that must run whole,
and wait for stage threads in a way an interrupt cannot cut short.

Ctrl-C in a notebook raises `KeyboardInterrupt` in the main thread, between any two
bytecodes. Two places of a step must not be cut in half:

* starting the stage threads, so that the caller knows exactly which ones run and waits
  for each of them;
* putting ``.grad`` back in order at the end of a step (committing the step's gradients,
  or restoring those of before a failed step): half of it would leave some parameters
  with this step's gradient and others without.

`interrupts_held` defers SIGINT over such a block and raises it right after, as if it had
come a moment later. Waiting for the threads is the other half: ``Thread.join()``
interrupted by Ctrl-C on CPython 3.11 marks the thread as stopped although it still runs
(``is_alive()`` then says False), so a step could return while a stage thread went on
adding its backward into the next step's gradients. `wait_until_set` waits on an `Event`
that each thread sets as the very last thing it does, through any number of interrupts.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterable, Iterator


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Run the block without SIGINT; one that came meanwhile is raised when it ends.

    Only the main thread receives signals, so elsewhere this holds nothing (and needs to
    hold nothing). Where a handler was not installed from Python (``getsignal`` gives
    None), it cannot be put back afterwards, so the block runs unprotected.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is None):
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:   # delivered again, now to the handler the caller had
            signal.raise_signal(signal.SIGINT)


def wait_until_set(events: Iterable[threading.Event]) -> None:
    """Wait until every event is set, through any number of interrupts. For threads
    already told to stop, while the caller is on its way out with an exception anyway:
    each thread finishes its current action at most, and a further Ctrl-C must not cut
    that short, or the action would run on behind the caller's back. That Ctrl-C is
    answered with a line on stderr, so that a long action does not look like a hang."""
    told = False
    for event in events:
        while not event.is_set():
            try:
                event.wait()
            except KeyboardInterrupt:
                if not told:
                    print("Still waiting for the pipeline's threads to finish the action "
                          "each is in (an action cannot be cut short): they stop right "
                          "after it, and the step then raises.", file=sys.stderr)
                    told = True
