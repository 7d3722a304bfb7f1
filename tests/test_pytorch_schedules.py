"""PyTorch's schedules, read from its own action lists, beside ours: same placement, valid,
and ours never slower at the same memory."""
import itertools

import pytest

from pipeline_lib.course.pytorch_schedules import PYTORCH_NAMES, pytorch_schedule, side_by_side
from pipeline_lib.schedules import (Action, LOOPED, ScheduleError, build, dualpipe_v,
                                    looped_bfs, validate)
from pipeline_lib.timeline import simulate, summary

MULTI = [b for b in PYTORCH_NAMES if b not in ("gpipe", "1f1b")]   # several stages a rank


def both(builder, p, m):
    v = 2 if builder in MULTI else None
    return build(builder, p, m, v or 2), pytorch_schedule(PYTORCH_NAMES[builder], p, m, v)


@pytest.mark.parametrize("builder", MULTI)
@pytest.mark.parametrize("p,m", list(itertools.product([2, 3, 4], [2, 4, 5, 8, 9, 12])))
def test_pytorch_multi_stage_schedules_are_ours(builder, p, m):
    """Interleaved 1F1B, interleaved zero bubble, ZB-V and DualPipeV: PyTorch's action
    lists are ours, action for action (DualPipeV's overlapped pairs split forward first,
    and the same pairs recorded);
    LoopedBFS runs its backwards last micro-batch first, in the same time. Sizes PyTorch
    refuses (interleaved with m not divisible by its rounds, DualPipeV with m < 2p) are
    skipped: ours run them."""
    try:
        ours, theirs = both(builder, p, m)
    except ValueError as exc:
        assert "microbatches" in str(exc)
        pytest.skip(f"PyTorch refuses: {exc}")
    validate(theirs)
    assert theirs.placement == ours.placement
    assert theirs.stages == ours.stages == 2 * p
    if builder == "looped_bfs":
        assert [sorted(t) for t in theirs.actions] == [sorted(o) for o in ours.actions]
    else:
        assert theirs.actions == ours.actions
    assert theirs.meta.get("overlapped") == ours.meta.get("overlapped")   # DualPipeV's F&B
    costs = dict(forward=0.5, backward=1.0, weight=0.4, comm=0.1)
    mine, pytorch = (summary(s, simulate(s, **costs)) for s in (ours, theirs))
    assert mine["makespan"] == pytest.approx(pytorch["makespan"])
    assert mine["activations"] == pytest.approx(pytorch["activations"])


def test_dualpipe_v_pairs_are_recorded_and_run_forward_first():
    theirs = pytorch_schedule("DualPipeV", 2, 4, 2)
    pairs = theirs.meta["overlapped"]
    assert pairs and all(f.kind == "F" and b.kind == "B" for f, b in pairs)
    program = theirs.actions[0]
    for f, b in pairs:
        if f in program:
            assert program[program.index(f) + 1] == b
    assert theirs.actions == dualpipe_v(2, 4).actions


def test_pytorch_1f1b_list_breaks_on_the_last_rank():
    """PyTorch's visualiser lists its single-stage 1F1B with the last rank's micro-batches
    off by one (its runtime does not use that list): `validate` says so."""
    theirs = pytorch_schedule("1F1B", 4, 8)
    assert theirs.actions[:-1] == build("1f1b", 4, 8).actions[:-1]
    with pytest.raises(ScheduleError, match="3F8 is out of range"):
        validate(theirs)


def test_side_by_side_ours_never_worse_at_the_same_memory():
    rows = side_by_side(4, 8, forward=1.0, backward=2.0, weight=1.0, comm=0.1)
    by = {(r["builder"], r["source"]): r for r in rows}
    assert {b for b, _ in by} == set(PYTORCH_NAMES)
    assert "error" in by[("1f1b", "pytorch")]
    for builder in PYTORCH_NAMES:
        ours, theirs = by[(builder, "ours")], by[(builder, "pytorch")]
        assert "error" not in ours
        if "error" not in theirs and ours["activations"] <= theirs["activations"]:
            assert ours["makespan"] <= theirs["makespan"] + 1e-9
    assert by[("zb_v", "ours")]["messages"] < by[("interleaved_zero_bubble", "ours")]["messages"]


def test_side_by_side_names_what_pytorch_refuses():
    rows = side_by_side(4, 6)
    refused = {r["builder"]: r["error"] for r in rows if "error" in r}
    assert "DualPipeV requires at least as many microbatches as stages" in refused["dualpipe_v"]
    assert "error" not in next(r for r in rows if r["builder"] == "dualpipe_v"
                               and r["source"] == "ours")


def test_looped_schedules_keep_looped_placement():
    assert pytorch_schedule("Interleaved1F1B", 2, 4, 3).placement is None
    assert pytorch_schedule("LoopedBFS", 2, 4, 3).stages == looped_bfs(2, 4, 3).stages == 6
    assert Action(5, "F", 0) in pytorch_schedule("LoopedBFS", 2, 4, 3).actions[1]
    assert set(LOOPED) < set(PYTORCH_NAMES)

