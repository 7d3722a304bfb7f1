"""Tensor parallelism (by hand and by PyTorch's plans, with and without sequence
parallelism), FSDP on a pipeline stage's micro-batches and both together compute what one
process computes, and move the bytes their formulas say.

One torchrun job of 4 gloo processes (`tp_worker.py`, a ``tp × dp`` = 2 × 2 mesh) runs
every case; the tests compare each rank's results with this process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tp_worker as worker
from pipeline_lib.distributed.launch import kill_job
from pipeline_lib.lm.loops import lm_loss

REPO = Path(__file__).resolve().parent.parent
RANKS = range(4)
TP_GROUPS = [[0, 1], [2, 3]]   # order "tp-dp": tp fastest
DP_GROUPS = [[0, 2], [1, 3]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "4", str(REPO / "tests" / "tp_worker.py"), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        output = process.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"tp_worker hung for 300 s:\n{kill_job(process)}")
    assert process.returncode == 0, output[-5000:]
    return [torch.load(out / f"rank{r}.pt") for r in RANKS]


def reference(steps: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole batch: the loss and the gradients (``steps`` accumulated)."""
    model = worker.tiny_lm()
    inputs, targets = worker.batch()
    for _ in range(steps):
        loss = lm_loss(model(inputs), targets)
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def close(got: torch.Tensor, want: torch.Tensor, what: str = "", scale: float | None = None
          ) -> None:
    """Equal within float32 rounding relative to ``scale`` (the tensor's largest value,
    or the largest of all the gradients compared: a gradient that is zero in exact
    arithmetic, the key projection's bias, is rounding noise); sums over ranks add in
    another order."""
    scale = float(want.abs().max()) if scale is None else scale
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale, msg=what or None)


def assert_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    scale = max(float(g.abs().max()) for g in want.values())
    for name, grad in got.items():
        close(grad, want[name], f"{what}: {name}", scale)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("gather", [False, True], ids=["loss-parallel", "gathered"])
def test_tensor_parallel_plans_equal_one_process(ranks, sp, gather):
    loss, grads = reference()
    for r in RANKS:
        got = ranks[r][("tp", sp, gather)]
        assert got["loss"] == pytest.approx(loss, rel=1e-5)
        assert_grads(got["grads"], grads, f"rank {r}")


def single_block(dropout: float = 0.0):
    block = worker.tiny_lm(dropout)[1]
    x = worker.block_input().requires_grad_()
    out = block(x)
    worker.block_loss(out).backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_block_by_hand_and_by_plan_equal_one_process(ranks, sp):
    out, input_grad, grads = single_block()
    for r in RANKS:
        for way in ("hand", "plan"):
            got = ranks[r][("block", sp)][way]
            part = r % 2 if sp else slice(None)
            want_out = out.chunk(2, 1)[part] if sp else out
            want_grad = input_grad.chunk(2, 1)[part] if sp else input_grad
            close(got["out"], want_out)
            close(got["input_grad"], want_grad)
            assert_grads(got["grads"], grads, f"rank {r}, {way}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_two_collectives_per_block_each_way(ranks, sp):
    """Megatron-LM's count: two all-reduces in the forward, two in the backward, of one
    activation each (B × T × d floats); sequence parallelism turns each into an
    all-gather and a reduce-scatter of the same size. By hand and by plan alike.

    Under sequence parallelism the norms' weights and the row-parallel biases act on
    each rank's positions, so their gradients must be summed over the ranks: by hand,
    f sums them in each backward (six small all-reduces); PyTorch leaves them as
    ``Partial`` DTensors, summed when first used (Megatron-LM sums them once a step)."""
    activation = 3 * worker.SEQ * 16 * 4
    want = ([("tp", "all_gather", activation, 2), ("tp", "reduce_scatter", activation, 2)] * 2
            if sp else [("tp", "all_reduce", activation, 2)] * 2)
    for way in ("hand", "plan"):
        got = ranks[0][("block", sp)][way]
        assert got["forward"] == want, way
        backward = [m for m in got["backward"] if m[2] == activation]
        assert sorted(backward) == sorted(want), way   # each mirror, in reverse order
        small = [m for m in got["backward"] if m[2] != activation]
        assert small == ([("tp", "all_reduce", 16 * 4, 2)] * 6 if sp and way == "hand"
                         else []), way


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dropout_masks_under_tensor_parallelism(ranks, sp):
    """A block draws four masks: the attention probabilities (its heads), after the
    attention, inside the MLP (its hidden units), after the MLP. The masks of what every
    rank holds whole (the branches' outputs, unless sequence parallelism splits their
    positions) agree across a tp group, the others differ; and the split by hand draws
    exactly what the plan draws."""
    whole = [False, not sp, False, not sp]
    for group in TP_GROUPS:
        a, b = (ranks[r][("dropout", sp)]["plan"]["masks"] for r in group)
        assert len(a) == len(b) == 4
        assert tuple(a[0].shape) == (3, 2, worker.SEQ, worker.SEQ)   # 2 of the 4 heads
        assert [torch.equal(x, y) for x, y in zip(a, b)] == whole
        for r in group:
            hand, plan = (ranks[r][("dropout", sp)][way] for way in ("hand", "plan"))
            assert all(torch.equal(x, y) for x, y in zip(hand["masks"], plan["masks"]))
            close(hand["out"], plan["out"])
        if not sp:   # the block's output is whole on every rank: the same on both
            first, second = (ranks[r][("dropout", sp)]["plan"]["out"] for r in group)
            assert torch.equal(first, second)


def parameter_bytes() -> int:
    return sum(p.numel() * 4 for p in worker.tiny_lm().parameters())


@pytest.mark.parametrize("order", list(worker.ORDERS))
@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "keep"])
def test_fsdp_on_a_pipeline_stage(ranks, order, reshard):
    """FSDP driven through a stage's micro-batches in each schedule family's order gives
    one process's gradients (two steps accumulated), and reduce-scatters each layer once
    per step: (d − 1)/d of the parameters' bytes sent per rank. It all-gathers each layer
    before every forward and backward of a micro-batch (2·m times a step) when resharding
    after forward, once a step otherwise; a split backward (ZB-H1) keeps the layers
    gathered from I to W, so it gathers once."""
    _, grads = reference(steps=2)
    half = parameter_bytes() / 2                     # (d − 1)/d with d = 2
    layers = 4                                       # embedding, 2 blocks, decoder
    gathers = 2 * worker.MICROBATCHES if reshard and order != "zb_h1" else 1
    for r in RANKS:
        got = ranks[r][("fsdp", order, reshard)]
        assert_grads(got["grads"], grads, f"rank {r}")
        kinds = [kind for _, kind, _, _ in got["messages"]]
        assert kinds.count("reduce_scatter") == layers
        assert kinds.count("all_gather") == gathers * layers
        sent = {kind: sum(size / 2 for _, k, size, _ in got["messages"] if k == kind)
                for kind in ("all_gather", "reduce_scatter")}
        assert sent == {"all_gather": gathers * half, "reduce_scatter": half}


def test_ddp_all_reduces_once_per_step(ranks):
    """DDP, armed for the last backward as `DistributedPipe` arms it: one process's
    gradients, 2(d − 1)/d of the parameters' bytes sent, as FSDP without resharding."""
    _, grads = reference()
    for r in RANKS:
        got = ranks[r][("ddp",)]
        assert_grads(got["grads"], grads, f"rank {r}")
        assert {kind for _, kind, _, _ in got["messages"]} == {"all_reduce"}
        assert sum(size for *_, size, _ in got["messages"]) == parameter_bytes()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("data", ["fsdp", "replicate"])
def test_tensor_and_data_parallel_together(ranks, sp, data):
    """Tensor parallelism over tp, and over dp FSDP or `replicate_stage` (DDP's
    all-reduce for DTensor weights, which DistributedDataParallel refuses), 1F1B's order,
    loss-parallel: one process's gradients; the data dimension's messages stay in the dp
    groups (one all-reduce per layer for replicas), the plan's in tp."""
    _, grads = reference()
    for r in RANKS:
        got = ranks[r][("2d", sp, data)]
        assert_grads(got["grads"], grads, f"rank {r}")
        dims = {(dim, kind) for dim, kind, _, _ in got["messages"]}
        assert {kind for dim, kind in dims if dim == "dp"} == (
            {"all_gather", "reduce_scatter"} if data == "fsdp" else {"all_reduce"})
        if data == "replicate":
            assert sum(dim == "dp" for dim, *_ in got["messages"]) == 4   # one per layer
        assert {kind for dim, kind in dims if dim == "tp"} >= (
            {"all_gather", "reduce_scatter"} if sp else {"all_reduce"})
        assert all(dim in ("tp", "dp") for dim, _ in dims)
