"""Notebook 06's exercise checks, in-process: per exercise the solution passes, and the
plausible wrong answers and the library shortcut each fail with a message that says what
is wrong (the notebook's check cell adds the exercise's name)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import pytest
from torch import nn

from pipeline_lib.course.checks import nb06
from pipeline_lib.course.exercises import ExerciseFailed
from pipeline_lib.course.pytorch_schedules import pytorch_schedule
from pipeline_lib.schedules import Action, Schedule

ROWS, HIDDEN = 4, 16


# -- 6.1 -----------------------------------------------------------------------------------

def run_stage(rank, stage, x, target):
    """The notebook's solution."""
    if rank == 0:
        activation = stage(x)
        dist.send(activation.detach(), dst=1)
        grad = torch.empty_like(activation)
        dist.recv(grad, src=1)
        activation.backward(grad)
        return None
    activation = torch.empty(ROWS, HIDDEN)
    dist.recv(activation, src=0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    dist.send(activation.grad, dst=0)
    return output.detach()


def run_stage_async(rank, stage, x, target):
    """The solution with isend/irecv."""
    if rank == 0:
        activation = stage(x)
        dist.isend(activation.detach(), dst=1).wait()
        grad = torch.empty_like(activation)
        dist.irecv(grad, src=1).wait()
        activation.backward(grad)
        return None
    activation = torch.empty(ROWS, HIDDEN)
    dist.irecv(activation, src=0).wait()
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    dist.isend(activation.grad, dst=0).wait()
    return output.detach()


def never_sends(rank, stage, x, target):
    """The issue's shortcut: each rank rebuilds the global model and runs it whole."""
    model = nb06.tiny_model()
    for name, p in model.named_parameters():      # its own stage's weights, the rest copied
        if name in dict(stage.named_parameters()):
            dict(stage.named_parameters())[name].data = p.data
    whole = nn.Sequential(*(stage if rank == 0 else model[:2]),
                          *(model[2:] if rank == 0 else stage))
    output = whole(x)
    nn.functional.mse_loss(output, target).backward()
    return None if rank == 0 else output.detach()


def receives_first(rank, stage, x, target):
    """Both ranks wait for the other: a deadlock."""
    if rank == 0:
        grad = torch.empty(ROWS, HIDDEN)
        dist.recv(grad, src=1)
        activation = stage(x)
        dist.send(activation.detach(), dst=1)
        activation.backward(grad)
        return None
    return run_stage(rank, stage, x, target)


def no_requires_grad(rank, stage, x, target):
    """Rank 1 forgets requires_grad_(): it has no activation gradient and sends zeros."""
    if rank == 0:
        return run_stage(rank, stage, x, target)
    activation = torch.empty(ROWS, HIDDEN)
    dist.recv(activation, src=0)
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    dist.send(torch.zeros(ROWS, HIDDEN), dst=0)
    return output.detach()


def ignores_received_gradient(rank, stage, x, target):
    """Rank 0 receives the gradient but backpropagates a loss of its own."""
    if rank == 1:
        return run_stage(rank, stage, x, target)
    activation = stage(x)
    dist.send(activation.detach(), dst=1)
    grad = torch.empty_like(activation)
    dist.recv(grad, src=1)
    activation.sum().backward()
    return None


def sends_output_gradient(rank, stage, x, target):
    """Rank 1 sends the output's gradient (4 × 8), not the activation's."""
    if rank == 0:
        return run_stage(rank, stage, x, target)
    activation = torch.empty(ROWS, HIDDEN)
    dist.recv(activation, src=0)
    activation.requires_grad_()
    output = stage(activation)
    output.retain_grad()
    nn.functional.mse_loss(output, target).backward()
    dist.send(output.grad, dst=0)
    return output.detach()


def stub(rank, stage, x, target):
    raise NotImplementedError()


@pytest.mark.parametrize("answer", [run_stage, run_stage_async])
def test_6_1_solution_passes(answer):
    nb06.check_send_recv(answer)


@pytest.mark.parametrize("answer, says", [
    (never_sends, "sent 0 messages"),
    (receives_first, "waits for a message from rank"),
    (no_requires_grad, "requires_grad_()"),
    (ignores_received_gradient, "activation.backward(grad)"),
    (sends_output_gradient, "a message of (4, 8)"),
])
def test_6_1_wrong_answers_fail(answer, says):
    with pytest.raises(ExerciseFailed, match=None) as failed:
        nb06.check_send_recv(answer)
    assert says in str(failed.value)


def test_6_1_stub_is_not_done():
    with pytest.raises(NotImplementedError):
        nb06.check_send_recv(stub)


def test_6_1_transport_restores_torch_distributed():
    before = dist.send, dist.recv, dist.isend, dist.irecv, dist.get_rank
    nb06.check_send_recv(run_stage)
    assert (dist.send, dist.recv, dist.isend, dist.irecv, dist.get_rank) == before


# -- 6.2 -----------------------------------------------------------------------------------

KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def compute(op):
    return [Action(a.stage_index, KINDS[a.computation_type.name], a.microbatch_index)
            for a in (op.sub_actions or (op,)) if a.computation_type.name in KINDS]


def schedule_from(actions, microbatches, name, looped_placement=False):
    ranks = len(actions)
    where = {a.stage: rank for rank, program in enumerate(actions) for a in program}
    placement = tuple(where[s] for s in range(len(where)))
    looped = placement == tuple(s % ranks for s in range(len(where)))
    return Schedule(name, ranks, microbatches, actions, virtual_stages=len(where) // ranks,
                    placement=None if looped or looped_placement else placement)


def from_lowered(ops, microbatches, name="PyTorch"):
    """The notebook's solution."""
    actions = [[a for op in rank_ops if op is not None for a in compute(op)]
               for rank_ops in ops]
    return schedule_from(actions, microbatches, name)


def ignores_overlapped_pairs(ops, microbatches, name="PyTorch"):
    actions = [[Action(op.stage_index, KINDS[op.computation_type.name], op.microbatch_index)
                for op in rank_ops if op is not None and op.computation_type.name in KINDS]
               for rank_ops in ops]
    return schedule_from(actions, microbatches, name)


def always_looped(ops, microbatches, name="PyTorch"):
    actions = [[a for op in rank_ops if op is not None for a in compute(op)]
               for rank_ops in ops]
    return schedule_from(actions, microbatches, name, looped_placement=True)


def i_and_w_as_b(ops, microbatches, name="PyTorch"):
    """Reads I as B and drops W: the zero-bubble schedules lose their split backward."""
    actions = [[Action(a.stage, "B", a.microbatch) if a.kind == "I" else a
                for op in rank_ops if op is not None for a in compute(op) if a.kind != "W"]
               for rank_ops in ops]
    return schedule_from(actions, microbatches, name)


def sorted_by_microbatch(ops, microbatches, name="PyTorch"):
    actions = [sorted((a for op in rank_ops if op is not None for a in compute(op)),
                      key=lambda a: (a.microbatch, a.kind != "F"))
               for rank_ops in ops]
    return schedule_from(actions, microbatches, name)


def shortcut(ops, microbatches, name="PyTorch"):
    """The reference solution itself, imported as a learner would."""
    from pipeline_lib.course.pytorch_schedules import pytorch_schedule as reference
    return reference(name, len(ops), microbatches, 2)


def test_6_2_solution_passes():
    nb06.check_from_lowered(from_lowered)


@pytest.mark.parametrize("answer, says", [
    (ignores_overlapped_pairs, "DualPipeV"),
    (always_looped, "placement"),
    (i_and_w_as_b, "InterleavedZeroBubble"),
    (sorted_by_microbatch, "first difference"),
    (shortcut, "your code calls `pytorch_schedule`"),
])
def test_6_2_wrong_answers_fail(answer, says):
    with pytest.raises(ExerciseFailed) as failed:
        nb06.check_from_lowered(answer)
    assert says in str(failed.value)


def test_6_2_shortcut_through_the_notebook_namespace_fails():
    namespace = {"pytorch_schedule": pytorch_schedule}

    def through_namespace(ops, microbatches, name="PyTorch"):
        return namespace["pytorch_schedule"](name, len(ops), microbatches, 2)

    with pytest.raises(ExerciseFailed, match="pytorch_schedule"):
        nb06.check_from_lowered(through_namespace, namespace=namespace)
    assert namespace["pytorch_schedule"] is pytorch_schedule


# -- 6.3 -----------------------------------------------------------------------------------

def make_groups(rank, pp, dp):
    """The notebook's solution: every rank creates every group, in one order."""
    pipeline_groups = [dist.new_group([d * pp + p for p in range(pp)]) for d in range(dp)]
    data_groups = [dist.new_group([d * pp + p for d in range(dp)]) for p in range(pp)]
    replica, pipe_rank = divmod(rank, pp)
    return pipeline_groups[replica], data_groups[pipe_rank]


def only_its_own(rank, pp, dp):
    replica, pipe_rank = divmod(rank, pp)
    return (dist.new_group([replica * pp + p for p in range(pp)]),
            dist.new_group([d * pp + pipe_rank for d in range(dp)]))


def transposed(rank, pp, dp):
    """Pipeline groups are the columns: rank = pipe_rank * dp + replica."""
    pipeline_groups = [dist.new_group([p * dp + d for p in range(pp)]) for d in range(dp)]
    data_groups = [dist.new_group([p * dp + d for d in range(dp)]) for p in range(pp)]
    pipe_rank, replica = divmod(rank, dp)
    return pipeline_groups[replica], data_groups[pipe_rank]


def divides_by_dp(rank, pp, dp):
    """pp and dp mixed up in the rank arithmetic: right on a square mesh only."""
    pipeline_groups = [dist.new_group([d * pp + p for p in range(pp)]) for d in range(dp)]
    data_groups = [dist.new_group([d * pp + p for d in range(dp)]) for p in range(pp)]
    replica, pipe_rank = divmod(rank, dp)
    return pipeline_groups[replica % dp], data_groups[pipe_rank % pp]


def swapped_return(rank, pp, dp):
    pipe, data = make_groups(rank, pp, dp)
    return data, pipe


def mesh_shortcut(rank, pp, dp):
    from pipeline_lib.distributed.mesh import init_mesh
    mesh = init_mesh(pp, dp)
    return mesh.pipe_group, mesh.dp_group


def test_6_3_solution_passes():
    nb06.check_groups(make_groups)


@pytest.mark.parametrize("answer, says", [
    (only_its_own, "collective"),
    (transposed, "pipeline group"),
    (divides_by_dp, "pp=4, dp=2"),
    (swapped_return, "pipeline group"),
    (mesh_shortcut, "your code calls `init_mesh`"),
])
def test_6_3_wrong_answers_fail(answer, says):
    with pytest.raises(ExerciseFailed) as failed:
        nb06.check_groups(answer)
    assert says in str(failed.value)


def test_6_3_restores_torch_distributed():
    before = dist.new_group, dist.get_rank, dist.get_world_size
    with pytest.raises(ExerciseFailed):
        nb06.check_groups(transposed)
    assert (dist.new_group, dist.get_rank, dist.get_world_size) == before


# -- 6.1 under torchrun: the real send and recv, counted ------------------------------------

SCRIPT = '''
import torch
import torch.distributed as dist
from torch import nn

def run_stage(rank, stage, x, target):
{body}
'''

SOLUTION_BODY = '''
    if rank == 0:
        activation = stage(x)
        dist.send(activation.detach(), dst=1)
        grad = torch.empty_like(activation)
        dist.recv(grad, src=1)
        activation.backward(grad)
        return None
    activation = torch.empty(4, 16)
    dist.recv(activation, src=0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    dist.send(activation.grad, dst=0)
    return output.detach()
'''

NEVER_SENDS_BODY = '''
    from pipeline_lib.course.checks.nb06 import tiny_model
    model = tiny_model()
    own = dict(stage.named_parameters())
    for name, p in model.named_parameters():
        if name in own:
            own[name].data = p.data
    whole = nn.Sequential(*(stage if rank == 0 else model[:2]),
                          *(model[2:] if rank == 0 else stage))
    output = whole(x)
    nn.functional.mse_loss(output, target).backward()
    return None if rank == 0 else output.detach()
'''


BATCHED_BODY = '''
    from torch.distributed import P2POp, batch_isend_irecv, recv, send
    def post(op, tensor, peer):
        for work in batch_isend_irecv([P2POp(op, tensor, group_peer=peer)]):
            work.wait()
    if rank == 0:
        activation = stage(x)
        post(dist.isend, activation.detach(), 1)
        grad = torch.empty_like(activation)
        recv(grad, group_src=1)
        activation.backward(grad)
        return None
    activation = torch.empty(4, 16)
    post(dist.irecv, activation, 0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    send(activation.grad, group_dst=0)
    return output.detach()
'''


@pytest.mark.parametrize("body, says", [(SOLUTION_BODY, None), (BATCHED_BODY, None),
                                        (NEVER_SENDS_BODY, "sent 0 messages")])
def test_6_1_under_torchrun_counts_the_real_sends(tmp_path, monkeypatch, body, says):
    import os
    from pipeline_lib.distributed.launch import torchrun
    (tmp_path / "answer_6_1.py").write_text(SCRIPT.format(body=body))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    torchrun("pipeline_lib.course.checks.nb06", ["answer_6_1", tmp_path], nproc=2,
             timeout=120)
    results = nb06.read_worker_results(tmp_path)
    if says is None:
        nb06.verify_send_recv(results)
    else:
        with pytest.raises(ExerciseFailed, match=says):
            nb06.verify_send_recv(results)


def test_notebook_06_binds_no_name_to_the_reference_solution_before_its_check():
    """`pytorch_schedule` is 6.2's answer: the notebook reaches it only through its module
    (which the check withholds), never as a name of its own a learner could call."""
    import re
    from pathlib import Path

    import nbformat
    path = Path(__file__).resolve().parents[1] / "notebooks" / "06_torch_pipelining.ipynb"
    cells = nbformat.read(path, as_version=4).cells
    check = next(i for i, cell in enumerate(cells)
                 if cell.metadata.get("nbgrader", {}).get("grade_id") == "ex-6-2-check")
    bare = re.compile(r"(?<![\w.])pytorch_schedule\b")
    assert not [i for i, cell in enumerate(cells[:check])
                if cell.cell_type == "code" and bare.search(cell.source)]


# -- A second reader's answers: right ones written another way must pass, wrong ones fail --

def run_stage_imported_names(rank, stage, x, target):
    """The solution with ``from torch.distributed import send, recv``: names of the
    learner's own, which the check must reach as it reaches ``dist.send``."""
    from torch.distributed import recv, send
    if rank == 0:
        activation = stage(x)
        send(activation.detach(), dst=1)
        grad = torch.empty_like(activation)
        recv(grad, src=1)
        activation.backward(grad)
        return None
    activation = torch.empty(ROWS, HIDDEN)
    recv(activation, src=0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    send(activation.grad, dst=0)
    return output.detach()


def run_stage_batched(rank, stage, x, target):
    """The solution with ``batch_isend_irecv`` and ``group_src``/``group_dst``, as
    PyTorch's own stages post their messages."""
    def post(op, tensor, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, group_peer=peer)]):
            work.wait()
    if rank == 0:
        activation = stage(x)
        post(dist.isend, activation.detach(), 1)
        grad = torch.empty_like(activation)
        dist.recv(grad, group_src=1)
        activation.backward(grad)
        return None
    activation = torch.empty(ROWS, HIDDEN)
    post(dist.irecv, activation, 0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    dist.send(activation.grad, group_dst=0)
    return output.detach()


def summed_loss(rank, stage, x, target):
    """MSE summed instead of averaged: every gradient 32 times too large."""
    if rank == 0:
        return run_stage(rank, stage, x, target)
    activation = torch.empty(ROWS, HIDDEN)
    dist.recv(activation, src=0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target, reduction="sum").backward()
    dist.send(activation.grad, dst=0)
    return output.detach()


def sends_activation_back(rank, stage, x, target):
    """Rank 1 sends back the activation it received, not its gradient."""
    if rank == 0:
        return run_stage(rank, stage, x, target)
    activation = torch.empty(ROWS, HIDDEN)
    dist.recv(activation, src=0)
    activation.requires_grad_()
    output = stage(activation)
    nn.functional.mse_loss(output, target).backward()
    dist.send(activation.detach(), dst=0)
    return output.detach()


def forgets_the_output(rank, stage, x, target):
    result = run_stage(rank, stage, x, target)
    return None if rank == 1 else result


@pytest.mark.parametrize("answer", [run_stage_imported_names, run_stage_batched])
def test_6_1_right_answers_written_otherwise_pass(answer):
    before = dist.send, dist.recv, dist.isend, dist.irecv, dist.P2POp
    nb06.check_send_recv(answer)
    assert (dist.send, dist.recv, dist.isend, dist.irecv, dist.P2POp) == before


@pytest.mark.parametrize("answer, says", [
    (summed_loss, "32 times that gradient"),
    (sends_activation_back, "not the gradient of the loss"),
    (forgets_the_output, "rank 1 must return the output"),
])
def test_6_1_more_wrong_answers_fail(answer, says):
    with pytest.raises(ExerciseFailed) as failed:
        nb06.check_send_recv(answer)
    assert says in str(failed.value)


def fixed_virtual_stages(ops, microbatches, name="PyTorch"):
    """Two stages per rank written in: right for every V-shaped schedule, not in general."""
    actions = [[a for op in rank_ops if op is not None for a in compute(op)]
               for rank_ops in ops]
    where = {a.stage: rank for rank, program in enumerate(actions) for a in program}
    return Schedule(name, len(actions), microbatches, actions, virtual_stages=2,
                    placement=tuple(where[s] for s in range(2 * len(actions))))


def asks_pytorch_again(ops, microbatches, name="PyTorch"):
    """Ignores ``ops``: PyTorch's unlowered order for the schedule named ``name``."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    return from_lowered(get_schedule_ops(name, len(ops), microbatches, 2), microbatches,
                        name)


def test_6_2_fixed_virtual_stages_fails():
    with pytest.raises(ExerciseFailed, match="4 stages per rank"):
        nb06.check_from_lowered(fixed_virtual_stages)


def test_6_2_an_answer_that_ignores_ops_fails():
    """The check's ``name`` is a label, no schedule PyTorch knows: the notebook's
    ``exercise`` turns the error into "your code raised ValueError: Unknown schedule"."""
    with pytest.raises(ValueError, match="Unknown schedule name 'lowered Interleaved1F1B'"):
        nb06.check_from_lowered(asks_pytorch_again)


def data_groups_first_ranks_reversed(rank, pp, dp):
    """Right: any one order of creation on every rank, ranks in any order in a group
    (``new_group`` sorts them)."""
    data_groups = [dist.new_group([d * pp + p for d in range(dp)]) for p in range(pp)]
    pipeline_groups = [dist.new_group([d * pp + p for p in reversed(range(pp))])
                       for d in range(dp)]
    replica, pipe_rank = divmod(rank, pp)
    return pipeline_groups[replica], data_groups[pipe_rank]


def by_enumeration(rank, pp, dp):
    """Right: PyTorch's ``new_subgroups_by_enumeration`` creates every group on every rank."""
    pipe, _ = dist.new_subgroups_by_enumeration(
        [[d * pp + p for p in range(pp)] for d in range(dp)])
    data, _ = dist.new_subgroups_by_enumeration(
        [[d * pp + p for d in range(dp)] for p in range(pp)])
    return pipe, data


def own_group_first(rank, pp, dp):
    """Every group created, but the rank's own pipeline first: the order differs by rank."""
    replica, pipe_rank = divmod(rank, pp)
    mine = dist.new_group([replica * pp + p for p in range(pp)])
    for d in range(dp):
        if d != replica:
            dist.new_group([d * pp + p for p in range(pp)])
    data_groups = [dist.new_group([d * pp + p for d in range(dp)]) for p in range(pp)]
    return mine, data_groups[pipe_rank]


def world_group(rank, pp, dp):
    group = dist.new_group()
    return group, group


@pytest.mark.parametrize("answer", [data_groups_first_ranks_reversed, by_enumeration])
def test_6_3_right_answers_written_otherwise_pass(answer):
    nb06.check_groups(answer)


@pytest.mark.parametrize("answer, says", [
    (own_group_first, "collective"),
    (world_group, "got the pipeline group [0, 1, 2, 3]"),
])
def test_6_3_more_wrong_answers_fail(answer, says):
    with pytest.raises(ExerciseFailed) as failed:
        nb06.check_groups(answer)
    assert says in str(failed.value)


def test_6_2_a_table_of_the_shown_cases_fails_on_the_drawn_ones():
    table = {(len(nb06._lowered(*case)), case[2], f"lowered {case[0]}"): pytorch_schedule(*case)
             for case in nb06.LOWERED_CASES}

    def from_table(ops, microbatches, name):
        return table[len(ops), microbatches, name]
    for _ in range(2):               # not in the table, or another case's schedule
        with pytest.raises((KeyError, ExerciseFailed)):
            nb06.check_from_lowered(from_table)


def test_6_3_a_table_of_the_shown_meshes_fails_on_the_drawn_ones():
    shown = {(pp, dp) for pp, dp in nb06.MESHES}

    def from_table(rank, pp, dp):
        assert (pp, dp) in shown, "not a mesh of my table"
        return make_groups(rank, pp, dp)
    for _ in range(2):
        with pytest.raises(AssertionError, match="not a mesh of my table"):
            nb06.check_groups(from_table)


def test_6_3_messages_do_not_give_the_right_groups():
    with pytest.raises(ExerciseFailed) as failed:
        nb06.check_groups(transposed)
    assert "not the ranks of its replica's pipeline" in str(failed.value)
    assert "its pipeline is ranks" not in str(failed.value)
