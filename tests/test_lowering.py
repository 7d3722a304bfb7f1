"""Lowering: every schedule compiles into per-rank programs whose messages pair up and
cannot deadlock, the same messages PyTorch's lowering adds to the same compute actions,
plus skip tensors; hand-broken programs are refused naming rank, step and message."""
import itertools

import pytest
from torch.distributed.pipelining.schedules import _Action, _add_send_recv

from pipeline_lib.lowering import (LoweredSchedule, Message, Receive, Send, Step, lower,
                                   lower_forward, validate_lowered)
from pipeline_lib.schedules import (BUILDERS, LOOPED, Action, Schedule, ScheduleError, build,
                                    gpipe, interleaved_1f1b, one_f_one_b, validate, zb_v)
from pipeline_lib.skip import DEFAULT_NAMESPACE, Namespace, SkipRoute

SIZES = [(name, p, m) for name in BUILDERS for p, m in itertools.product((1, 2, 3, 4), (1, 3, 5))]


def built(name: str, p: int, m: int) -> Schedule:
    return build(name, p, m, 3 if name in LOOPED else 2)


def skips(stages: int) -> list[SkipRoute]:
    """A skip from the first stage to the last (past every other) and one between
    neighbours, where the stages allow."""
    routes = [SkipRoute((DEFAULT_NAMESPACE, "long"), 0, stages - 1)] if stages > 1 else []
    if stages > 2:
        routes.append(SkipRoute((Namespace("inner"), "short"), 1, 2))
    return routes


@pytest.mark.parametrize("name,p,m", SIZES)
def test_every_consumer_receives_what_its_producer_sends_right_before_and_after(name, p, m):
    schedule = built(name, p, m)
    routes = skips(schedule.stages)
    lowered = lower(schedule, routes)
    assert [[step.action for step in program] for program in lowered.programs] == \
        schedule.actions
    for rank, program in enumerate(lowered.programs):
        for step in program:
            a = step.action
            for send in step.sends:   # produced by this very action, for the right rank
                assert send.message.source == a.stage and send.message.microbatch == a.microbatch
                assert send.peer == schedule.rank_of(send.message.stage)
                assert send.local == (send.peer == rank)
            for receive in step.receives:   # consumed by this very action
                m_ = receive.message
                assert (m_.stage, m_.microbatch) == (a.stage, a.microbatch)
                assert (m_.kind in ("activation", "skip")) == (a.kind == "F")
                assert receive.peer == schedule.rank_of(m_.source)
    # what travels: each boundary both ways, and each skip route both ways, per micro-batch
    messages = {s.message for program in lowered.programs for step in program
                for s in step.sends}
    S = schedule.stages
    expected = {Message("activation", s + 1, i, s) for s in range(S - 1) for i in range(m)}
    expected |= {Message("gradient", s, i, s + 1) for s in range(S - 1) for i in range(m)}
    expected |= {Message("skip", r.target, i, r.source, r.key) for r in routes for i in range(m)}
    expected |= {Message("skip-grad", r.source, i, r.target, r.key)
                 for r in routes for i in range(m)}
    assert messages == expected


def pytorch_lowering(schedule: Schedule) -> dict[int, list[str]]:
    compute = {r: [_Action.from_str(str(a)) for a in program]
               for r, program in enumerate(schedule.actions)}
    lowered = _add_send_recv(compute, schedule.rank_of, schedule.stages)
    return {r: [str(a) for a in program] for r, program in lowered.items()}


@pytest.mark.parametrize("name,p,m", [c for c in SIZES if c[1] > 1])
def test_messages_are_pytorchs_with_each_send_right_after_its_action(name, p, m):
    """PyTorch's `_add_send_recv` lowers the same compute actions to the same SEND and
    RECV actions (none between stages of one rank), each send right after the action
    that produced it; it places a receive where the sender sent it, we right before the
    action that consumes it."""
    schedule = built(name, p, m)
    ours, theirs = lower(schedule), pytorch_lowering(schedule)
    for rank in range(p):
        mine = ours.text(rank).split()
        assert [op for op in mine if "RECV" not in op] == \
            [op for op in theirs[rank] if "RECV" not in op]
        assert sorted(op for op in mine if "RECV" in op) == \
            sorted(op for op in theirs[rank] if "RECV" in op)
        for op in mine:   # the strings PyTorch reads
            assert str(_Action.from_str(op)) == op


def test_text_is_pytorchs_notation_with_skips_in_brackets():
    lowered = lower(one_f_one_b(2, 2))
    assert lowered.grid().splitlines() == [
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"]
    routes = [SkipRoute((DEFAULT_NAMESPACE, "shortcut"), 0, 2),
              SkipRoute((Namespace("inner"), "x"), 0, 1)]
    rank0, rank1, rank2 = (lower(gpipe(3, 1), routes).text(r).split() for r in range(3))
    assert rank0 == ["0F0", "0SEND_F0", "0SEND_SKIP_F0[shortcut]", "0SEND_SKIP_F0[x@inner]",
                     "0RECV_B0", "0RECV_SKIP_B0[shortcut]", "0RECV_SKIP_B0[x@inner]", "0B0"]
    assert rank1[:2] == ["1RECV_F0", "1RECV_SKIP_F0[x@inner]"]
    assert rank2 == ["2RECV_F0", "2RECV_SKIP_F0[shortcut]", "2F0", "2B0", "2SEND_B0",
                     "2SEND_SKIP_B0[shortcut]"]
    assert str(Message("skip-grad", 0, 1, 2, routes[0].key)) == \
        "the gradient of skip tensor 'shortcut' for stage 0, micro-batch 1"
    assert str(Message("activation", 1, 0, 0)) == "the activation for stage 1, micro-batch 0"


@pytest.mark.parametrize("schedule", [interleaved_1f1b(1, 2, 2), zb_v(2, 2)],
                         ids=["pp=1", "V"])
def test_messages_between_stages_of_one_rank_are_local_and_left_out_of_the_text(schedule):
    """One rank holds both stages of pp=1 and the turn of a V: those messages are lowered
    (`local`, handed over in memory) but, as in PyTorch, not written."""
    lowered = lower(schedule)
    turn = schedule.stages // 2 - 1   # stage p - 1 hands to stage p on one rank
    local = [op for r in range(lowered.ranks) for op in lowered.ops(r, local=True)
             if not isinstance(op, Action) and op.local]
    assert local and all(schedule.rank_of(op.message.stage) ==
                         schedule.rank_of(op.message.source) for op in local)
    assert any(op.message == Message("activation", turn + 1, 0, turn) for op in local)
    here = schedule.rank_of(turn)
    assert f"{turn}SEND_F0" in lowered.text(here, local=True).split()
    assert f"{turn + 1}RECV_F0" in lowered.text(here, local=True).split()
    for r in range(lowered.ranks):
        shown = lowered.text(r).split()
        assert all(str(op) not in shown for op in local if op.peer == r)
    assert all(lowered.channel(r, r) == [] for r in range(lowered.ranks))


def test_channels_list_each_links_messages_in_the_senders_order():
    """What a receiver that matches by order (NCCL, gloo per group) needs: rank 0's
    backwards run last micro-batch first, but rank 1 sends the gradients first first."""
    m = 3
    reordered = Schedule("reordered", 2, m, [
        [Action(0, "F", i) for i in range(m)] + [Action(0, "B", i) for i in reversed(range(m))],
        [Action(1, "F", i) for i in range(m)] + [Action(1, "B", i) for i in range(m)]])
    lowered = lower(reordered)
    assert lowered.channel(1, 0) == [Message("gradient", 0, i, 1) for i in range(m)]
    assert lowered.channel(0, 1) == [Message("activation", 1, i, 0) for i in range(m)]
    assert lowered.pairs() == [(0, 1), (1, 0)]
    assert lower(interleaved_1f1b(3, 3, 2)).pairs() == \
        [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    # a skip between ranks that are not neighbours adds their pair
    far = SkipRoute((DEFAULT_NAMESPACE, "far"), 0, 3)
    assert (0, 3) in lower(one_f_one_b(4, 2), [far]).pairs()
    assert (0, 3) not in lower(one_f_one_b(4, 2)).pairs()


def test_forward_only_lowering_runs_one_rank_per_stage_with_skips():
    route = SkipRoute((DEFAULT_NAMESPACE, "s"), 0, 2)
    lowered = lower_forward(3, 2, [route])
    assert lowered.grid().splitlines() == [
        "rank 0: 0F0 0SEND_F0 0SEND_SKIP_F0[s] 0F1 0SEND_F1 0SEND_SKIP_F1[s]",
        "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1",
        "rank 2: 2RECV_F0 2RECV_SKIP_F0[s] 2F0 2RECV_F1 2RECV_SKIP_F1[s] 2F1"]


def test_a_schedule_error_is_the_validators():
    """`lower` validates the compute schedule first: its errors are `validate`'s."""
    broken = one_f_one_b(2, 2)
    broken.actions[1].remove(Action(1, "B", 1))
    with pytest.raises(ScheduleError) as validated:
        validate(broken)
    with pytest.raises(ScheduleError) as lowered:
        lower(broken)
    assert str(lowered.value) == str(validated.value)
    with pytest.raises(ScheduleError, match="does not go forward"):
        lower(one_f_one_b(2, 2), [SkipRoute((DEFAULT_NAMESPACE, "back"), 1, 0)])


# -- hand-broken lowered programs ---------------------------------------------------------

def edited(lowered: LoweredSchedule, rank: int, step: int, **change) -> LoweredSchedule:
    programs = [list(p) for p in lowered.programs]
    programs[rank][step] = programs[rank][step]._replace(**change)
    return LoweredSchedule(lowered.schedule, lowered.routes, tuple(map(tuple, programs)))


ONE_F_ONE_B = lower(one_f_one_b(2, 2))   # rank 0: 0F0 0F1 0B0 0B1; rank 1: 1F0 1B0 1F1 1B1


def test_a_receive_before_the_send_it_waits_for_is_a_deadlock_naming_both_sides():
    """Rank 0 waits for micro-batch 0's gradient before its first forward, which rank 1
    needs before it can send that gradient."""
    gradient = ONE_F_ONE_B.programs[0][2].receives
    broken = edited(edited(ONE_F_ONE_B, 0, 2, receives=()), 0, 0, receives=gradient)
    with pytest.raises(ScheduleError, match="would deadlock") as error:
        validate_lowered(broken)
    text = str(error.value)
    assert ("rank 0 step 0: 0RECV_B0 (for 0F0) waits for the gradient for stage 0, "
            "micro-batch 0, which rank 1 sends at its step 1 (1SEND_B0, after 1B0); rank 1 "
            "never gets there (it waits at its step 0)") in text
    assert "rank 1 step 0: 1RECV_F0 (for 1F0) waits for the activation for stage 1, " \
           "micro-batch 0, which rank 0 sends at its step 0" in text


def test_a_send_without_its_receive_and_a_receive_without_its_send_are_named():
    with pytest.raises(ScheduleError, match=r"rank 0 step 0: 0SEND_F0 sends the activation "
                                            r"for stage 1, micro-batch 0 to rank 1, which "
                                            r"never receives it"):
        validate_lowered(edited(ONE_F_ONE_B, 1, 0, receives=()))
    with pytest.raises(ScheduleError, match=r"rank 1 step 0: 1RECV_F0 waits for the "
                                            r"activation for stage 1, micro-batch 0 from "
                                            r"rank 0, which never sends it"):
        validate_lowered(edited(ONE_F_ONE_B, 0, 0, sends=()))


def test_a_message_twice_or_between_the_wrong_ranks_is_named():
    send = ONE_F_ONE_B.programs[0][0].sends[0]
    with pytest.raises(ScheduleError, match="0SEND_F0 .* appears twice"):
        validate_lowered(edited(ONE_F_ONE_B, 0, 1, sends=(send,)))
    with pytest.raises(ScheduleError, match="sends .* to rank 0, but rank 1 receives it"):
        validate_lowered(edited(ONE_F_ONE_B, 0, 0, sends=(send._replace(peer=0),)))
    receive = ONE_F_ONE_B.programs[1][0].receives[0]
    with pytest.raises(ScheduleError, match="but rank 1 receives it .* from rank 1"):
        validate_lowered(edited(ONE_F_ONE_B, 1, 0, receives=(receive._replace(peer=1),)))


def test_steps_and_ops_are_plain_tuples():
    step = ONE_F_ONE_B.programs[1][1]
    assert step == Step(Action(1, "B", 0), (), (Send(0, Message("gradient", 0, 0, 1), False),))
    assert [str(op) for op in ONE_F_ONE_B.programs[1][0].ops()] == ["1RECV_F0", "1F0"]
    assert isinstance(ONE_F_ONE_B.programs[1][0].receives[0], Receive)
