"""Our schedules in PyTorch's notation and back (`Schedule.to_pytorch`, `to_csv`,
`from_csv`), checked with PyTorch's own parser, validator and lowering; what PyTorch's
builders refuse; and the guard around its private API. No processes: the runs are in
tests/test_torch_pipelining.py."""
import ast
import csv
import itertools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from pipeline_lib.course.pytorch_schedules import pytorch_schedule
from pipeline_lib.lowering import lower
from pipeline_lib.pytorch import notation, private, runner
from pipeline_lib.skip import DEFAULT_NAMESPACE, SkipRoute
from pipeline_lib.schedules import (BUILDERS, Action, Schedule, ScheduleError, build,
                                    dualpipe_v, gpipe)

SIZES = [(2, 1), (2, 4), (2, 5), (3, 7), (4, 2), (4, 9)]
CASES = [(name, p, m) for name in BUILDERS for p, m in SIZES]


def torch_rows(rows):
    """Our rows as PyTorch's `_Action`s, by its own parser."""
    return {rank: [private.Action.from_str(cell) for cell in row]
            for rank, row in enumerate(rows)}


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_schedule_round_trips_and_pytorch_reads_validates_and_lowers_it(tmp_path, name,
                                                                              p, m):
    ours = build(name, p, m)
    for fmt in notation.FORMATS:
        path = ours.to_csv(tmp_path / f"{fmt}.csv", format=fmt)
        back = Schedule.from_csv(path)    # a compute_comms file's messages checked too
        assert (back.actions, back.placement, back.virtual_stages, back.microbatches) == \
            (ours.actions, ours.placement, ours.virtual_stages, ours.microbatches)
        assert back.meta.get("overlapped") == ours.meta.get("overlapped")
        assert notation.csv_format(notation.read_csv(path)) == fmt
    with (tmp_path / "compute_only.csv").open(newline="") as file:
        actions = torch_rows(list(csv.reader(file)))
    mapping = private.validate_schedule(actions, p, ours.stages, m)    # PyTorch's validator
    assert mapping == {s: ours.rank_of(s) for s in range(ours.stages)}
    lowered = private.add_send_recv(actions, lambda s: mapping[s], ours.stages)  # its lowering
    sends = [a for row in lowered.values() for a in row if a.computation_type.name == "SEND_F"]
    crossing = sum(1 for s in range(ours.stages - 1) if ours.rank_of(s) != ours.rank_of(s + 1))
    assert len(sends) == crossing * m


def test_to_pytorch_writes_pytorchs_strings():
    assert gpipe(2, 2).to_pytorch() == [["0F0", "0F1", "0B0", "0B1"],
                                        ["1F0", "1F1", "1B0", "1B1"]]
    zb = build("zb_h1", 2, 2).to_pytorch()
    assert zb[1] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]


def test_dualpipe_v_pairs_are_written_as_pytorch_writes_them():
    rows = dualpipe_v(2, 5).to_pytorch()
    theirs = [[str(op) for op in row if op is not None]
              for row in private.schedule_ops("DualPipeV", 2, 5, 2)]
    assert rows == theirs
    assert "(0F3;3B1)OVERLAP_F_B" in rows[0]
    plain = dualpipe_v(2, 5).to_pytorch(overlap=False)
    assert not any("OVERLAP" in cell for row in plain for cell in row)
    assert [[a for c in row for a in notation.compute_actions(notation.parse(c))]
            for row in rows] == dualpipe_v(2, 5).actions


def test_pytorch_dumped_csv_reads_back_as_pytorchs_schedule(tmp_path):
    """A CSV as PyTorch's `_dump_csv` writes it (`_Action`s through csv.writer, None as an
    empty cell) reads back as the schedule PyTorch built."""
    for name, p, m, v in [("Interleaved1F1B", 2, 4, 2), ("InterleavedZeroBubble", 4, 8, 2),
                          ("ZBVZeroBubble", 2, 4, 2), ("DualPipeV", 2, 5, 2)]:
        ops = private.schedule_ops(name, p, m, v)
        with (tmp_path / "dump.csv").open("w", newline="") as file:
            csv.writer(file).writerows(ops)
        ours = Schedule.from_csv(tmp_path / "dump.csv", microbatches=m)
        theirs = pytorch_schedule(name, p, m, v)
        assert (ours.actions, ours.placement, ours.meta) == \
            (theirs.actions, theirs.placement, theirs.meta)


def test_a_compute_comms_csv_reads_as_its_compute_order(tmp_path):
    """PyTorch's lowered program (sends, receives, UNSHARD, REDUCE_GRAD...) as a CSV:
    its compute actions, in order; the format is told from the cells."""
    ops = private.schedule_ops("Interleaved1F1B", 2, 4, 2, with_comms=True)
    notation.write_csv(ops, tmp_path / "comms.csv")
    rows = notation.read_csv(tmp_path / "comms.csv")
    assert notation.csv_format(rows) == "compute_comms"
    assert any(isinstance(t, notation.Message) for t in rows[0])
    assert Schedule.from_csv(tmp_path / "comms.csv").actions == \
        build("interleaved_1f1b", 2, 4).actions
    assert notation.csv_format([[Action(0, "F", 0)]]) == "compute_only"


def test_parse_reads_every_form_and_is_stricter_than_pytorch():
    assert notation.parse("12F3") == Action(12, "F", 3)
    assert notation.parse(" 1W0 ") == Action(1, "W", 0)
    assert notation.parse("") is None
    assert notation.parse("0SEND_F1") == notation.Message(0, "SEND_F", 1)
    assert notation.parse("3RECV_B2") == notation.Message(3, "RECV_B", 2)
    assert notation.parse("2REDUCE_GRAD") == notation.Bookkeeping(2, "REDUCE_GRAD")
    pair = notation.parse("(0F7;7B3)OVERLAP_F_B")
    assert pair == notation.Overlapped((Action(0, "F", 7), Action(7, "B", 3)))
    assert str(pair) == "(0F7;7B3)OVERLAP_F_B"
    for text in ["0F1", "0SEND_F1", "2REDUCE_GRAD", "(0F7;7B3)OVERLAP_F_B"]:
        assert str(notation.parse(text)) == text == str(private.Action.from_str(text))
    assert str(private.Action.from_str("0F1x")) == "0F1"   # PyTorch reads a prefix ...
    with pytest.raises(ValueError, match="'0F1x' is not an action"):   # ... we refuse
        notation.parse("0F1x")
    with pytest.raises(ValueError, match="two or more compute actions"):
        notation.parse("(0F1)OVERLAP_F_B")


@pytest.mark.parametrize("rows, says", [
    ([["0F0", "0B0"], ["0F1", "0B1"]], "stage 0 has actions on rank 0 and on rank 1"),
    ([["0F0", "2F0", "0B0", "2B0"], ["1F0", "1B0"]], r"3 stages on 2 ranks"),
    ([["0F0", "0B0"], ["2F0", "2B0"]], r"stages \[1\] have no actions"),
    ([["0F0", "0B0"], []], "none on ranks \\[1\\]"),
    ([["0F0"], ["1F0", "1B0"]], "never runs B"),
    ([["0F0", "0B0"], ["1B0", "1F0"]], "deadlock"),
])
def test_from_rows_refuses_what_is_not_a_schedule(rows, says):
    with pytest.raises(ScheduleError, match=says):
        notation.from_rows(rows)


def test_read_csv_names_the_bad_cell(tmp_path):
    (tmp_path / "bad.csv").write_text("0F0,0B0\n1F0,1X0\n")
    with pytest.raises(ValueError, match=r"row 1 \(rank 1\), column 1: '1X0' is not"):
        Schedule.from_csv(tmp_path / "bad.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ValueError, match="empty"):
        Schedule.from_csv(tmp_path / "empty.csv")
    with pytest.raises(FileNotFoundError, match="no schedule CSV"):
        Schedule.from_csv(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="format='compute'"):
        gpipe(2, 2).to_csv(tmp_path / "x.csv", format="compute")


def test_to_pytorch_validates_first():
    broken = Schedule("broken", 2, 1, [[Action(0, "F", 0), Action(0, "B", 0)],
                                       [Action(1, "B", 0), Action(1, "F", 0)]])
    with pytest.raises(ScheduleError, match="deadlock"):
        broken.to_pytorch()


# -- compute_comms: our lowering's messages where PyTorch's runtime needs them ---------------

def channel_orders(rows):
    """Per rank, the messages it sends and those it receives, in its program's order."""
    sends, receives = {}, {}
    for rank, row in enumerate(rows):
        for token in row:
            if isinstance(token, notation.Message):
                table = sends if token.kind.startswith("SEND") else receives
                table.setdefault(rank, []).append(notation.lowered_message(token))
    return sends, receives


@pytest.mark.parametrize("name,p,m", CASES)
def test_comms_rows_carry_our_lowerings_messages_in_each_links_order(name, p, m):
    schedule = build(name, p, m)
    lowered = lower(schedule)
    rows = [[notation.parse(c) for c in row] for row in notation.comms_rows(lowered)]
    assert [[a for t in row for a in notation.compute_actions(t)] for row in rows] == \
        schedule.actions
    sends, receives = channel_orders(rows)
    for src, dst in lowered.pairs():
        sent = [m for m in sends[src] if schedule.rank_of(m.stage) == dst]
        got = [m for m in receives[dst] if schedule.rank_of(m.source) == src]
        assert sent == got == lowered.channel(src, dst)
    reduced = [t.stage for row in rows for t in row if isinstance(t, notation.Bookkeeping)]
    assert sorted(reduced) == list(range(schedule.stages))      # one REDUCE_GRAD a stage
    notation.check_messages(rows, schedule)


def raw_lowering(schedule):
    """Our lowering's text as is, each receive right before its consumer, with
    `comms_rows`' REDUCE_GRADs: right everywhere but in the order of a link's receives."""
    reduce = [[t for t in map(notation.parse, row) if isinstance(t, notation.Bookkeeping)]
              for row in notation.comms_rows(schedule)]
    lowered, out = lower(schedule), []
    for rank in range(schedule.ranks):
        row = [notation.parse(op) for op in lowered.text(rank).split()]
        for token in reduce[rank]:      # after the stage's last backward and its sends
            k = max(k for k, t in enumerate(row) if isinstance(t, Action)
                    and t.stage == token.stage and t.kind in "BW") + 1
            while k < len(row) and isinstance(row[k], notation.Message) \
                    and row[k].kind.startswith("SEND"):
                k += 1
            row.insert(k, token)
        out.append(row)
    return out


def test_receives_out_of_a_links_order_are_refused():
    """Interleaved 1F1B on 2 ranks, 5 micro-batches: rank 1 consumes rank 0's messages in
    another order than rank 0 sends them. Posted that way in PyTorch's runtime (one tag,
    links matched by order) the receives get each other's tensors: the step ran, with
    gradients off by 4.7e2 (tried once, by hand). `comms_rows` posts them in the link's
    order."""
    schedule = build("interleaved_1f1b", 2, 5)
    with pytest.raises(ScheduleError, match="a link matches receives to sends by order"):
        notation.check_messages(raw_lowering(schedule), schedule)
    notation.check_messages(raw_lowering(gpipe(2, 3)), gpipe(2, 3))   # in order there


def edited(rows, rank, change):
    rows = [list(row) for row in rows]
    change(rows[rank])
    return rows


@pytest.mark.parametrize("change, says", [
    (lambda row: row.remove(notation.Message(1, "RECV_F", 0)),
     "runs before it receives the activation for stage 1, micro-batch 0"),
    (lambda row: row.remove(notation.Message(1, "SEND_B", 1)),
     "does not send the gradient for stage 0, micro-batch 1"),
    (lambda row: row.insert(0, row.pop(row.index(notation.Message(1, "SEND_B", 0)))),
     "sends before 1B0 computes it"),
    (lambda row: row.append(notation.Message(1, "RECV_F", 0)), "appears twice"),
    (lambda row: row.append(notation.Message(1, "SEND_F", 0)),
     "is not a message rank 1 sends"),
])
def test_check_messages_names_what_is_wrong(change, says):
    schedule = gpipe(2, 2)
    rows = [[notation.parse(c) for c in row] for row in notation.comms_rows(schedule)]
    notation.check_messages(rows, schedule)
    with pytest.raises(ScheduleError, match=says):
        notation.check_messages(edited(rows, 1, change), schedule)


def test_a_comms_csv_without_reduce_grad_is_refused_before_it_runs(tmp_path):
    """PyTorch's runtime divides the gradients by m at REDUCE_GRAD only: without it they
    are m times too large, and nothing says so."""
    rows = [[c for c in row if "REDUCE_GRAD" not in c] for row in
            notation.comms_rows(build("zb_h1", 2, 3))]
    notation.write_csv(rows, tmp_path / "no_reduce.csv")
    Schedule.from_csv(tmp_path / "no_reduce.csv")        # a fine schedule ...
    with pytest.raises(ValueError, match=r"rank 0: stage 0 has no 0REDUCE_GRAD after its "
                                         r"last backward \(0W2"):
        runner.exported(tmp_path / "no_reduce.csv")      # ... that would train wrong here


def test_skip_connections_are_refused_with_the_reason():
    lowered = lower(gpipe(3, 2), [SkipRoute((DEFAULT_NAMESPACE, "shortcut"), 0, 2)])
    with pytest.raises(ValueError, match=r"skip connections \(shortcut\) have no place"):
        notation.comms_rows(lowered)


# -- what PyTorch's own builders refuse, and ours run (recorded: an upgrade shows) -----------

REFUSED = [
    ("1F1B", 4, 2, None, "1f1b",
     "Number of microbatches (2) must be greater than or equal to the number of stages (4)."),
    ("Interleaved1F1B", 4, 9, 2, "interleaved_1f1b",
     "Interleaved 1F1B requires the number of microbatches to be a multiple of the number "
     "of rounds (2), but got 9."),
    ("Interleaved1F1B", 2, 5, 2, "interleaved_1f1b",
     "Interleaved 1F1B requires the number of microbatches to be a multiple of the number "
     "of rounds (2), but got 5."),
    ("InterleavedZeroBubble", 4, 9, 2, "interleaved_zero_bubble",
     "Zero bubble requires the number of microbatches to be a multiple of the number of "
     "rounds (2), but got 9."),
    ("DualPipeV", 4, 6, 2, "dualpipe_v",
     "DualPipeV requires at least as many microbatches as stages, but got 6 microbatches "
     "and 8 stages."),
    ("DualPipeV", 2, 1, 2, "dualpipe_v",
     "DualPipeV requires at least as many microbatches as stages, but got 1 microbatches "
     "and 4 stages."),
]


@pytest.mark.parametrize("theirs,p,m,v,ours,message", REFUSED)
def test_pytorch_builders_refuse_sizes_ours_export(theirs, p, m, v, ours, message):
    """PyTorch's builder refuses these sizes with these words; our schedule of the same
    name and sizes exports, and PyTorch's validator and lowering accept it (its runtime
    runs it: tests/test_torch_pipelining.py)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        private.schedule_ops(theirs, p, m, v)
    schedule = build(ours, p, m)
    actions = torch_rows(schedule.to_pytorch())
    mapping = private.validate_schedule(actions, p, schedule.stages, m)
    private.add_send_recv(actions, lambda s: mapping[s], schedule.stages)


# -- the guard around PyTorch's private API ------------------------------------------------

@pytest.fixture
def fresh_private(monkeypatch):
    """The guard with nothing looked up yet (every name is checked on its first use)."""
    for name in private.NAMES:
        monkeypatch.delitem(vars(private), name, raising=False)
    monkeypatch.setattr(private, "_warned", False)
    return private


def test_a_missing_private_module_says_what_moved_and_what_is_tested(fresh_private,
                                                                     monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch.distributed.pipelining._schedule_visualizer", None)
    with pytest.raises(private.PrivateAPIMoved,
                       match=r"_schedule_visualizer is missing in torch .*tested with torch "
                             r"2\.13.*pip install torch==2\.13\.0"):
        pytorch_schedule("GPipe", 2, 4)


def test_a_missing_private_name_or_member_says_which(fresh_private, monkeypatch):
    from torch.distributed.pipelining import schedules
    monkeypatch.delattr(schedules, "_PipelineScheduleRuntime")
    with pytest.raises(private.PrivateAPIMoved,
                       match=r"schedules\._PipelineScheduleRuntime is missing"):
        fresh_private.Runtime
    monkeypatch.delattr(schedules._Action, "from_str")
    with pytest.raises(private.PrivateAPIMoved, match=r"_Action has no from_str"):
        fresh_private.Action


def test_a_renamed_parameter_says_which(fresh_private, monkeypatch):
    from torch.distributed.pipelining import schedules

    def load(self, filename, fmt="compute_only"):
        pass
    monkeypatch.setattr(schedules._PipelineScheduleRuntime, "_load_csv", load)
    with pytest.raises(private.PrivateAPIMoved,
                       match=r"Runtime\._load_csv takes no parameter format"):
        fresh_private.Runtime


def test_an_untested_torch_warns_once_and_works(fresh_private, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.warns(UserWarning, match=r"torch 2\.99\.0: .*tested with torch 2\.13"):
        assert fresh_private.Action.from_str("0F1").microbatch_index == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh_private.Runtime                  # warned already


def test_the_tested_torch_is_this_one_and_unknown_names_say_what_exists(fresh_private):
    assert private._version() in private.TESTED_VERSIONS     # CI runs the pinned torch
    with pytest.raises(AttributeError, match="private names it provides are"):
        fresh_private.Nothing


def _private_imports(source: str) -> list[str]:
    """The private names of torch.distributed.pipelining that ``source`` imports or reaches
    as a module's attribute."""
    found = []
    with warnings.catch_warnings():         # a notebook's regex literal, say: not our concern
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.distributed.pipelining"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") or "._" in node.module]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and "pipelining" in ast.unparse(node.value):
            found.append(ast.unparse(node))
    return found


def test_nothing_else_imports_the_private_api():
    """One module imports torch.distributed.pipelining's private names: every source file
    and notebook cell of the suite, parsed."""
    root = Path(__file__).resolve().parents[1]
    found = {}
    for path in itertools.chain((root / "pipeline_lib").rglob("*.py"),
                                (root / "bench").rglob("*.py")):
        if path != root / "pipeline_lib" / "pytorch" / "private.py":
            found[str(path.relative_to(root))] = _private_imports(path.read_text())
    for path in (root / "notebooks").glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        code = "\n".join(line for source in sources for line in source.splitlines()
                         if not line.lstrip().startswith(("%", "!")))
        found[str(path.relative_to(root))] = _private_imports(code)
    assert {path: names for path, names in found.items() if names} == {}
    assert _private_imports("from torch.distributed.pipelining.schedules import _Action\n"
                            "x = torch.distributed.pipelining.schedules._Action")


def test_torchtitan_config_places_the_stages_as_the_csv_does(tmp_path):
    """torchtitan runs the CSV on _PipelineScheduleRuntime but cuts and places the stages by
    a schedule's name: one that places them as ours does."""
    lines = {name: notation.torchtitan_config(build(name, 4, 8), tmp_path / "s.csv", 2)
             for name in ("zb_h1", "interleaved_zero_bubble", "dualpipe_v")}
    assert 'pipeline_parallel_schedule = "1F1B"' in lines["zb_h1"]
    assert 'pipeline_parallel_schedule = "Interleaved1F1B"' in lines["interleaved_zero_bubble"]
    assert 'pipeline_parallel_schedule = "ZBVZeroBubble"' in lines["dualpipe_v"]
    for text in lines.values():
        assert f'pipeline_parallel_schedule_csv = "{tmp_path / "s.csv"}"' in text
        assert "pipeline_parallel_degree = 4" in text and "local_batch_size = 16" in text
        assert "pipeline_parallel_microbatch_size = 2" in text
    assert "makes 12 stages" in notation.torchtitan_config(build("looped_bfs", 4, 8, 3), "x")
    odd = Schedule("odd", 2, 1, [[Action(0, "F", 0), Action(1, "F", 0), Action(1, "B", 0),
                                  Action(0, "B", 0)], [Action(2, "F", 0), Action(3, "F", 0),
                                                       Action(3, "B", 0), Action(2, "B", 0)]],
                   virtual_stages=2, placement=(0, 0, 1, 1))
    with pytest.raises(ValueError, match=r"looped or in a V, not as \[0, 0, 1, 1\]"):
        notation.torchtitan_config(odd, "x")


@pytest.mark.parametrize("name,p,m,v", [("Interleaved1F1B", 2, 4, 2), ("LoopedBFS", 2, 3, 2),
                                        ("InterleavedZeroBubble", 4, 8, 2),
                                        ("ZBVZeroBubble", 2, 4, 2), ("DualPipeV", 2, 5, 2)])
def test_runtime_lowering_is_what_pytorchs_runtime_lowers(name, p, m, v):
    """Our replay of the runtime's lowering passes gives PyTorch's own schedules exactly
    the lowered program its visualiser gets from the runtime itself."""
    compute = [[str(op) for op in row if op is not None]
               for row in private.schedule_ops(name, p, m, v)]
    theirs = [[str(op) for op in row if op is not None]
              for row in private.schedule_ops(name, p, m, v, with_comms=True)]
    assert private.runtime_lowering(compute, p * v, m) == theirs
    schedule = notation.from_rows(compute, microbatches=m)
    notation.check_messages([[notation.parse(c) for c in row] for row in theirs], schedule)


def test_gantt_with_messages_marks_each_message_where_its_rank_reaches_it():
    import matplotlib
    matplotlib.use("Agg")
    from pipeline_lib.timeline import simulate
    from pipeline_lib.viz.plot import gantt_with_messages
    schedule = gpipe(2, 2)
    timeline = simulate(schedule, forward=1, backward=2, comm=0.5)
    rows = notation.comms_rows(schedule)
    ax = gantt_with_messages(timeline, rows)
    marks = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata()))
             for line in ax.lines}
    # rank 0 posts both gradient receives first (two ahead), and sends after each forward;
    # rank 1 posts both activation receives first, and sends after each backward
    assert sorted(marks["receive posted"]) == [(0, -0.4), (0, -0.4), (0, 0.6), (0, 0.6)]
    assert sorted(marks["send"]) == [(1, 0.4), (2, 0.4), (5.5, 1.4), (7.5, 1.4)]
    assert sorted(t.get_text() for t in ax.texts if t.get_text().strip() == "2") == [" 2", " 2"]


def test_run_step_refuses_a_batch_that_does_not_split_evenly():
    """PyTorch's runtime sizes its receive buffers from the first micro-batch: a smaller
    one would arrive in a buffer of the wrong size, so the step is refused first."""
    from types import SimpleNamespace
    stage = SimpleNamespace(is_first=True, is_last=True)
    schedule = SimpleNamespace(step=lambda *a, **k: pytest.fail("ran"))
    batch = torch.zeros(8, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="8 rows does not split into 3 equal micro-batches"):
        runner.run_step(schedule, [stage], 3, batch, batch)
    with pytest.raises(ValueError, match="holds the last stage: pass the batch's targets"):
        runner.run_step(schedule, [stage], 3, torch.zeros(9, 5, dtype=torch.long), None)
