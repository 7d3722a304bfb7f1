"""Is the pipeline faster? A measured step taken apart into factors that multiply.

A pipelined step does the work of its micro-batches, so it is compared twice: with the
same micro-batches run one after another on one device (what the pipeline overlaps:
its *speedup*, at best the *ideal* p·m/(m+p−1)), and with the whole batch in one piece
(what a user would otherwise run: the *net* speedup). Splitting a batch is not free (each
micro-batch re-reads every weight, and small matrices run slower), so

    net = micro-batching × speedup,        speedup = ideal × efficiency,

and, with the step's compute time and span (from its `Timeline`: ``sum(busy())`` and
``makespan``), the efficiency's shortfall splits into three measured losses whose product is exactly 1 / efficiency: the bubble beyond the schedule's fill and
drain, the *stretch* (actions running slower side by side than alone: shared cores, caches,
memory bandwidth), and the executor's *overhead* outside the actions. Notebooks 01, 03 and
06 print these so that a slow pipeline shows its measured reason, not a guess.
"""
from __future__ import annotations

from dataclasses import dataclass

STRETCH = "the stretch (actions slower than alone)"


def ideal_speedup(devices: int, microbatches: int) -> float:
    """p·m/(m+p−1): p equal stages, free messages, only the fill and drain lost."""
    return devices * microbatches / (microbatches + devices - 1)


@dataclass(frozen=True)
class Speed:
    """Seconds of one step each way (or summed over as many steps each way), on ``devices``
    devices (stage threads or ranks); ``ideal`` defaults to equal stages' (pass the
    simulator's for unequal ones)."""

    devices: int
    microbatches: int
    whole: float          # the batch in one piece, one device
    accumulated: float    # the same micro-batches one after another, one device
    step: float           # the pipelined step, wall time
    busy: float | None = None     # the pipelined step's compute, summed over devices
    span: float | None = None     # the pipelined step's first action's start to last's end
    ideal: float | None = None

    def __post_init__(self) -> None:
        if min(self.whole, self.accumulated, self.step) <= 0:
            raise ValueError(f"times must be positive, got whole={self.whole}, "
                             f"accumulated={self.accumulated}, step={self.step}")
        if self.ideal is None:
            object.__setattr__(self, "ideal", ideal_speedup(self.devices, self.microbatches))

    @property
    def micro_batching(self) -> float:
        """whole / accumulated: below 1, splitting the batch cost time before any overlap."""
        return self.whole / self.accumulated

    @property
    def speedup(self) -> float:
        return self.accumulated / self.step

    @property
    def efficiency(self) -> float:
        return self.speedup / self.ideal

    @property
    def net(self) -> float:
        return self.whole / self.step

    def losses(self) -> dict[str, float]:
        """The factors (1 = nothing lost) between the ideal and the measured speedup."""
        if self.busy is None or self.span is None:
            raise ValueError("losses() needs the pipelined step's busy= and span= (from its "
                             "timeline: sum(timeline.busy()), timeline.makespan)")
        utilisation = self.busy / (self.devices * self.span)
        return {"the bubble beyond fill and drain": self.ideal / self.devices / utilisation,
                STRETCH: self.busy / self.accumulated,
                "the overhead outside the actions": self.step / self.span}

    def verdict(self) -> str:
        """One sentence on what the numbers say."""
        net = ("faster than" if self.net > 1.05 else "slower than" if self.net < 0.95
               else "about as fast as")
        split = "cost" if self.micro_batching < 1 else "gained"
        text = (f"the step was {net} the whole batch on one device ({self.net:.2f}x): "
                f"cutting it into {self.microbatches} micro-batches {split} a factor "
                f"{self.micro_batching:.2f} before any overlap, and the pipeline ran "
                f"{self.speedup:.2f}x as fast as those micro-batches one after another, "
                f"{self.efficiency:.0%} of its ideal {self.ideal:.2f}x")
        if self.busy is None or self.span is None:
            return text + "."
        losses = self.losses()
        if self.efficiency < 0.95:
            worst = max(losses, key=losses.get)
            text += f"; the largest loss was {worst}, a factor of {losses[worst]:.2f}"
        elif self.efficiency > 1.05:
            text += (f"; above the ideal because its actions took {losses[STRETCH]:.2f}x "
                     f"the one-device time of the same work (a stretch below 1: they timed "
                     f"less work, or the one-device run was the slower one)")
        return text + "."
