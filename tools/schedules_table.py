"""Write SCHEDULES.md, the one-page table of the library's schedules that notebooks 02 and
02b point to: ``python tools/schedules_table.py > SCHEDULES.md``.

Its bubble, memory and message columns come from the simulator (`timeline.summary`), so
they are the numbers the notebooks draw and assert; tests/test_schedules_table.py keeps
the file equal to this script's output. The "implemented in" column was read from each
project's source: ``torch.distributed.pipelining`` (its ``get_schedule_class`` names),
torchtitan (``--parallelism.pipeline_parallel_schedule`` takes those names), Megatron-LM
(``megatron/core/pipeline_parallel/schedules.py``), the zero-bubble authors' Megatron-LM
fork and DeepSeek's DualPipe repository.
"""
from __future__ import annotations

import sys

from pipeline_lib.schedules import BUILDERS, build, stages_per_rank
from pipeline_lib.timeline import simulate, summary

RANKS, MICROBATCHES = 4, 8

#: Where each schedule runs outside this library (PyTorch's class; torchtitan's name for
#: it, which is PyTorch's; others').
IMPLEMENTED = {
    "gpipe": "PyTorch `ScheduleGPipe`; torchtitan `GPipe`",
    "1f1b": "PyTorch `Schedule1F1B`; torchtitan `1F1B` (its default); Megatron-LM "
            "(`forward_backward_pipelining_without_interleaving`)",
    "interleaved_1f1b": "PyTorch `ScheduleInterleaved1F1B`; torchtitan `Interleaved1F1B`; "
                        "Megatron-LM (`forward_backward_pipelining_with_interleaving`, "
                        "virtual pipeline stages)",
    "looped_bfs": "PyTorch `ScheduleLoopedBFS`; torchtitan `LoopedBFS`",
    "zb_h1": "the zero-bubble authors' Megatron-LM fork, `sail-sg/zero-bubble-pipeline-"
             "parallelism` (ZB1P: `--enable-zero-bubble`)",
    "zb_h2": "the same fork (ZB2P: `--zero-bubble-max-pending-backward` at twice the stages)",
    "interleaved_zero_bubble": "PyTorch `ScheduleInterleavedZeroBubble`; torchtitan "
                               "`InterleavedZeroBubble`",
    "zb_v": "PyTorch `ScheduleZBVZeroBubble`; torchtitan `ZBVZeroBubble`; the zero-bubble "
            "fork (ZBV: `--zero-bubble-v-schedule`)",
    "dualpipe_v": "PyTorch `ScheduleDualPipeV`; torchtitan `DualPipeV`; "
                  "`deepseek-ai/DualPipe` (`DualPipeV`)",
}

INTRO = f"""# The schedules on one page

Every schedule `pipeline_lib.schedules.build(name, ranks, microbatches)` knows, on
p = {RANKS} ranks with m = {MICROBATCHES} micro-batches, from the simulator: a stage's forward F,
input gradient I and weight gradient W all cost 1 (a full backward B = I + W = 2), and a
schedule with two virtual stages per rank gives each half a stage, at half the cost, so
every row is the same model on the same ranks (notebook 02b draws them all on one time
axis). Written by `tools/schedules_table.py`; `tests/test_schedules_table.py` keeps it
equal to the simulator's numbers.

* **step**: the simulated step, in units of F;
* **bubble**: the idle time of the worst rank, in units of F, and the idle share of the
  whole step (`Timeline.bubble_fraction`);
* **activations**: the peak, on the worst rank, in micro-batches of one stage's
  activations (a half-stage virtual stage counts ½);
* **messages**: activations and gradients sent between ranks in one step, all ranks;
* **implemented in**: outside this library, read from each project's source.

Notebooks 02 and 02b explain each schedule; notebook 02b checks the numbers against the
papers' formulas (DeepSeek-V3's Table 2, Qi et al.).
"""


def rows() -> list[dict]:
    """One row per schedule: its name, the simulator's numbers, where it is implemented."""
    table = []
    for name in BUILDERS:
        schedule = build(name, RANKS, MICROBATCHES)
        v = stages_per_rank(name)
        timeline = simulate(schedule, forward=1 / v, backward=2 / v, weight=1 / v)
        table.append({"name": name, **summary(schedule, timeline),
                      "implemented": IMPLEMENTED[name]})
    return table


def markdown() -> str:
    lines = [INTRO,
             "| `build(name)` | schedule | step | bubble | activations | messages | "
             "implemented in |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows():
        lines.append(f"| `{r['name']}` | {r['schedule']} | {r['makespan']:g} | "
                     f"{r['bubble']:g} ({r['bubble_fraction']:.0%}) | {r['activations']:g} | "
                     f"{r['messages']} | {r['implemented']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
