"""SCHEDULES.md, the one-page table notebooks 02 and 02b point to, says what the simulator
says, names every schedule, and names only PyTorch schedules that exist."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch.distributed.pipelining.schedules as torch_schedules

from pipeline_lib.schedules import BUILDERS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from schedules_table import IMPLEMENTED, markdown, rows  # noqa: E402


def test_the_file_is_the_simulators_table():
    assert (ROOT / "SCHEDULES.md").read_text(encoding="utf-8") == markdown(), \
        "SCHEDULES.md is out of date: python tools/schedules_table.py > SCHEDULES.md"


def test_every_schedule_has_a_row_and_the_numbers_notebook_02b_asserts():
    table = {r["name"]: r for r in rows()}
    assert set(table) == set(BUILDERS) == set(IMPLEMENTED)
    # notebook 02b's EXPECTED (step, bubble, activations) and messages, at p = 4, m = 8
    assert (table["zb_h1"]["makespan"], table["zb_h1"]["bubble"]) == (27, 3)
    assert (table["dualpipe_v"]["activations"], table["zb_v"]["messages"]) == (4.5, 96)
    assert table["interleaved_1f1b"]["bubble"] == 4.5 and table["gpipe"]["activations"] == 8


def test_the_pytorch_and_torchtitan_names_exist():
    for name, where in IMPLEMENTED.items():
        for cls in re.findall(r"PyTorch `(\w+)`", where):
            assert hasattr(torch_schedules, cls), (name, cls)
        for titan in re.findall(r"torchtitan `(\w+)`", where):   # torchtitan takes these
            assert torch_schedules.get_schedule_class(titan).__name__ in where, (name, titan)
