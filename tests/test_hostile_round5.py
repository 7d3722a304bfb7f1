"""Round 5 of the hostile user: one test per bug found in what merged after round 4
(`test_hostile_round4.py`): schedule CSVs and PyTorch's notation, the tp × pp × dp mesh
and its flags, the lowering of hand-written schedules, the notebooks' explorer. The cases
tried, and their outcomes before the fixes (ok: the right answer or the clear error
expected; "2 gloo" cases ran in a 2-process job, not kept as tests: they were ok):

| area | cases | not ok before |
|---|---|---|
| `to_pytorch` / `to_csv` / `from_csv` | round trips of 1F1B, ZB-V, DualPipeV, interleaved 1F1B, ZB-H2 (compute_only and compute_comms); a format "comms"; an empty file; blank lines only; a header row; lower-case actions; a missing B; a stage on two ranks; `microbatches` fewer, more, 0, -1; a folder; `;` and tab delimiters; a byte-order mark (Excel's "CSV UTF-8"); CRLF; a trailing row of empty cells; `00F01`; a micro-batch index of 10**8; an overlapped step of one action, nested, with an empty part; a compute_comms file missing a receive; binary bytes; W without I; I without W; an action twice; `from_rows` of empty rows; a file not UTF-8; quoted cells with spaces; `to_pytorch` of a schedule that deadlocks; `to_csv` into a missing folder and onto a folder; `torchtitan_config` of a placement neither looped nor a V; `comms_rows(ahead=0)` | the byte-order mark: "'\\ufeff0F0' is not an action"; not UTF-8: a bare UnicodeDecodeError without the file |
| mesh, `DistributedPipe`, `lm.train` (2 gloo) | `--tp 3`, `--tp 0`, `--tp 8` on the cpu preset; `--sequence-parallel` with an odd `--bptt`; `--fsdp` without `--dp`; `--reshard-after-forward` without `--fsdp`; `--no-reshard-after-forward --fsdp --dp 2`; `--tp 16 --preset tutorial`; `--batch` below dp × micro-batches; tp 2 with a vocabulary of 1001 and of 7 and `--bptt 3`; tp 2 with sequence parallelism, saved, resumed on pp 2, resumed with another vocabulary, with another `--bptt`; `DistributedPipe` on tp 2 with plain Linear layers, with 3 heads, sequence parallelism on 5 positions; `shard_parameters` with dp = 1 | plain Linear layers on tp 2: ran, every tp rank computing the whole stage, nothing split; `shard_parameters` on dp = 1: accepted, nothing sharded (`lm.train --fsdp` refuses it) |
| `plan.communication_bytes` / `executor_bytes` | tp 2 × pp 2 × dp 2; FSDP; tp 3 on 8 heads; one GPU; cp 2; full recompute; the distributed optimizer alone; more chunks than layers; ZB-V on pp 4; an unknown cluster; untied embeddings; GQA on tp 4; a gated MLP; FP8; a vocabulary of 1001 on tp 2 | none |
| `lowering` on hand-written schedules | rows swapped (placement (1, 0)); a placement too short, out of range, not the programs'; fewer programs than ranks; kind X; strings and tuples as actions; a skip route backwards; `validate_lowered` of a program missing a receive, with a send twice, a send to the wrong rank, a rank's program dropped, a rank's program reversed (deadlock); W before I; two looped stages on one rank; 3 ranks in crossed orders (valid); microbatches 1.0; virtual_stages True; DualPipeV's compute_comms CSV lowered again | none |
| `viz.explorer` | in a plain Python run (no IPython); a control for a parameter the function lacks; a parameter with neither default nor control; a value no control shows; a non-callable; the function failing for its defaults; `**kwargs`; an empty list | plain Python: AttributeError 'NoneType' has no 'display_pub'; the unknown control and the parameter without a value: Python's TypeError from the call; the value: AttributeError 'NoneType' has no 'description' |
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline_lib.schedules import Schedule, one_f_one_b

explorer_module = pytest.importorskip("pipeline_lib.viz.explorer")
pytest.importorskip("ipywidgets")


def test_a_csv_with_a_byte_order_mark_reads(tmp_path):
    """Excel's "CSV UTF-8" starts with U+FEFF, read as part of the first action."""
    schedule = one_f_one_b(2, 2)
    path = tmp_path / "excel.csv"
    path.write_text(schedule.to_csv(tmp_path / "plain.csv").read_text(), encoding="utf-8-sig")
    assert Schedule.from_csv(path).actions == schedule.actions


def test_a_csv_that_is_not_utf8_names_the_file(tmp_path):
    """It raised a bare UnicodeDecodeError, naming no file and no fix."""
    path = tmp_path / "latin.csv"
    path.write_bytes(b"0F0,0B0\xff\n")
    with pytest.raises(ValueError, match=r"latin.csv is not UTF-8 text \(byte 7\).*save it "
                                         r"as CSV \(UTF-8\)"):
        Schedule.from_csv(path)


def test_tensor_parallel_refuses_a_stage_it_cannot_split(one_rank_mesh):
    """A stage of plain Linear layers got an empty plan: every tp rank computed all of
    it, silently."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline_lib.parallel.tensor_parallel import tensor_parallel
    with pytest.raises(ValueError, match=r"holds none of them \(Linear, ReLU\).*run it with "
                                         r"tp=1"):
        tensor_parallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
                        init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))


def test_sharding_over_one_replica_is_refused(one_rank_mesh):
    """shard_parameters on dp = 1 was accepted and sharded nothing."""
    from pipeline_lib.distributed import DistributedPipe
    with pytest.raises(ValueError, match=r"this mesh has one \(dp = 1\)"):
        DistributedPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), one_rank_mesh,
                        [1, 1], 2, "zb_v", shard_parameters=True)


def draws(n: int = 2, name: str = "x") -> None:
    print(f"n={n} name={name}")


def test_explorer_in_plain_python_runs_the_defaults(capsys, monkeypatch):
    """Outside IPython (a notebook exported as a script) it raised AttributeError
    'NoneType' object has no attribute 'display_pub'."""
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    explorer_module.explorer(draws, n=(3, 8))
    assert capsys.readouterr().out == "n=3 name=x\n"


@pytest.mark.parametrize("controls, function, message", [
    (dict(m=(1, 4)), draws, r"draws has no parameter 'm' \(its parameters: n, name\)"),
    ({}, lambda k: None, r"parameter 'k' of <lambda> has no default and no control"),
    (dict(n=object()), draws, r"no control shows n=<object"),
])
def test_explorer_names_a_control_it_cannot_make(monkeypatch, controls, function, message):
    """Before: Python's TypeError from calling the function, or AttributeError 'NoneType'
    object has no attribute 'description'."""
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    with pytest.raises(ValueError, match=message):
        explorer_module.explorer(function, **controls)
