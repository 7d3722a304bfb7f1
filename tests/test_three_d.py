"""`DistributedPipe` on ``tp × pp × dp`` meshes computes what one process computes: each
schedule family, the replicas as DDP or FSDP, with and without sequence parallelism and
recompute; training goes on from a checkpoint on another tp, pp and dp; and the bytes
each rank sends on each mesh dimension are the planner's (`plan.communication_bytes`),
the differences named and counted.

One torchrun job of 8 gloo processes (`three_d_worker.py`) runs every case; the tests
compare each rank's records with this process."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import three_d_worker as worker
from pipeline_lib import run_state
from pipeline_lib.distributed.launch import kill_job
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.parallel import rank_order
from pipeline_lib.parallel.block import shardable
from pipeline_lib.plan import Cluster, Layout, Model, communication_bytes
from pipeline_lib.plan.costs import chunk_layers
from pipeline_lib.plan.memory import chunk_parameters
from pipeline_lib.schedules import build, splits_backward, stages_per_rank

REPO = Path(__file__).resolve().parent.parent
WORLD = 8
CASES = {case.name: case for case in worker.CASES}
# the worker's model as the planner describes it: the Transformer LM's blocks with their
# biases and norms, an output projection of its own (untied); no bias on that
# projection and no positional table among the parameters (the LM's is a fixed buffer)
MODEL = Model(layers=worker.LAYERS - 2, hidden=worker.MODEL["d_model"],
              heads=worker.MODEL["nhead"], seq_len=worker.SEQ, vocab=worker.VOCAB,
              ffn_hidden=worker.MODEL["d_hid"], tied_embeddings=False)
# what the bytes depend on: float32 values and gradients (the rest is unused here)
GLOO = Cluster("gloo processes", peak_flops=1e11, hbm_bytes=2**30, hbm_bandwidth=1e10,
               gpus_per_node=WORLD, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9,
               matmul_efficiency=1.0, bandwidth_efficiency=1.0, value_bytes=4)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("three_d")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(WORLD), str(REPO / "tests" / "three_d_worker.py"),
               "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        output = process.communicate(timeout=600)[0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"three_d_worker hung for 600 s:\n{kill_job(process)}")
    assert process.returncode == 0, output[-5000:]
    return out, [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def reference(k: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole batch ``k``: the loss and the gradients."""
    model = shardable(worker.tiny_lm())
    loss = lm_loss(model(worker.batch(k)[0]), worker.batch(k)[1])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                 scale: float) -> None:
    """Equal within float32 rounding relative to the largest gradient (a gradient that
    is zero in exact arithmetic, the key projection's bias, is rounding noise)."""
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m: f"{what}: {name}: {m}")


def covered(records: list[dict], name: str, want: dict) -> None:
    """Every parameter's gradient was recorded by some rank."""
    assert set().union(*(r[name]["grads"] for r in records)) == set(want), name


EQUIVALENCE = [c.name for c in worker.CASES if not c.resume and not c.dropout]


@pytest.mark.parametrize("name", EQUIVALENCE)
def test_each_layout_gives_one_process_loss_and_gradients(job, name):
    _, records = job
    loss, grads = reference()
    scale = max(float(g.abs().max()) for g in grads.values())
    for r, record in enumerate(records):
        got = record[name]
        if got["loss"] is not None:
            assert got["loss"] == pytest.approx(loss, rel=1e-5), f"rank {r}"
        assert_grads(got["grads"], grads, f"{name}, rank {r}", scale)
    covered(records, name, grads)


def test_ranks_sit_where_the_rank_order_puts_them(job):
    """Megatron-LM's order numbers tp fastest, then dp, then pp; Llama 3's tp, pp, dp."""
    _, records = job
    for name in ("gpipe", "1f1b sp", "resume pp 4", "resume tp 4", "resume tp 1 fsdp"):
        tp, pp, dp, order = CASES[name].mesh
        for r, record in enumerate(records):
            coords = rank_order.coordinates(r, order, {"tp": tp, "pp": pp, "dp": dp})
            assert record[name]["place"] == (coords["tp"], coords["pp"], coords["dp"])
    assert [records[r]["gpipe"]["place"] for r in range(4)] == \
        [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]


def test_dropout_under_tensor_parallelism(job):
    """With dropout, recomputing every micro-batch replays its masks exactly (the
    sharded regions' own streams included: the same gradients as without recompute);
    the masks do drop (gradients unlike the run without dropout); and every rank of a
    tensor-parallel group computes the same loss."""
    _, records = job
    _, plain = reference()
    scale = max(float(g.abs().max()) for g in plain.values())
    for r, record in enumerate(records):
        dropped, replayed = record["dropout"], record["dropout recompute"]
        assert replayed["loss"] == dropped["loss"]
        assert_grads(replayed["grads"], dropped["grads"], f"rank {r}", scale)
        assert any(not torch.allclose(g, plain[n], rtol=1e-3, atol=1e-3 * scale)
                   for n, g in dropped["grads"].items())
    losses = {r["dropout"]["loss"] for r in records if r["dropout"]["loss"] is not None}
    assert len(losses) == 1


def two_steps() -> dict:
    """One process: the clipped AdamW step of batch 0, then batch 1's loss, gradients,
    norm, and the weights after its clipped update."""
    model = shardable(worker.tiny_lm())
    optimizer = torch.optim.AdamW(model.parameters(), lr=worker.LR)
    found = {}
    for k in range(2):
        optimizer.zero_grad()
        loss = lm_loss(model(worker.batch(k)[0]), worker.batch(k)[1])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP).item()
        optimizer.step()
        found[k] = dict(loss=loss.item(), grads=grads, norm=norm,
                        weights={n: p.detach().clone() for n, p in model.named_parameters()},
                        state=model.state_dict())
    return found


@pytest.mark.parametrize("name", [c.name for c in worker.CASES if c.resume])
def test_training_goes_on_from_a_checkpoint_on_another_layout(job, name):
    """Case "train" (2 × 2 × 2, FSDP, sequence parallel) clips the gradient norm over
    all three dimensions and takes an AdamW step, and saves; the run resumes on another
    tp, pp and dp (FSDP on or off), steps, clips and updates: the same loss, gradients,
    norm and weights as one process's two steps. Adam's moments are restored: without
    them the second update would differ (its bias correction and its normalisation).
    The key projection's bias is left out of the weights: its gradient is zero in exact
    arithmetic, and Adam normalises the rounding noise into an update of order lr."""
    out, records = job
    want = two_steps()
    scale = max(float(g.abs().max()) for g in want[1]["grads"].values())
    for r, record in enumerate(records):
        assert record["train"]["norm"] == pytest.approx(want[0]["norm"], rel=1e-5)
        got = record[name]
        assert got["done"] == 1
        assert got["norm"] == pytest.approx(want[1]["norm"], rel=1e-5)
        if got["loss"] is not None:
            assert got["loss"] == pytest.approx(want[1]["loss"], rel=1e-5)
        assert_grads(got["grads"], want[1]["grads"], f"{name}, rank {r}", scale)
        for n, w in got["weights"].items():
            if not n.endswith("k_proj.bias"):
                torch.testing.assert_close(w, want[1]["weights"][n], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{name}, rank {r}: {n}: {m}")
    covered(records, name, want[1]["grads"])
    merged = run_state.merged_state_dict(out / "checkpoint")   # the unpipelined names
    assert merged.keys() == want[0]["state"].keys()
    for n, w in merged.items():
        torch.testing.assert_close(w, want[0]["state"][n], rtol=1e-5, atol=1e-6)


# -- the bytes, against the planner -------------------------------------------------------

def layout_of(case: worker.Case) -> Layout:
    """The planner's `Layout` of a case: FSDP is ZeRO-3 (shard_parameters), its weights
    resharded after forward unless kept, or unless the schedule splits its backward (the
    executor keeps them gathered for W)."""
    tp, pp, dp, _ = case.mesh
    sharded = case.data != "ddp"
    split = bool(splits_backward(build(case.schedule, pp, case.microbatches)))
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch=worker.ROWS // (dp * case.microbatches),
                  global_batch=worker.ROWS, schedule=case.schedule,
                  virtual_stages=stages_per_rank(case.schedule) if "interleaved" in
                  case.schedule else 1, sequence_parallel=case.sequence_parallel,
                  distributed_optimizer=sharded, shard_gradients=sharded,
                  shard_parameters=sharded,
                  reshard_after_forward=case.data == "fsdp" and not split)


def run_bytes(messages: list[tuple[str, str, int, int]]) -> dict[str, float]:
    """Bytes this rank sent per dimension, as `Traffic.sent` counts them."""
    share = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
             "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0,
             "receive": lambda n: 0.0}
    sent = dict.fromkeys(("tp", "pp", "dp"), 0.0)
    for dim, kind, size, ranks in messages:
        if dim in sent:
            sent[dim] += share[kind](ranks) * size
    return sent


def expected_bytes(case: worker.Case, pipe_rank: int) -> dict[str, float]:
    """The planner's bytes for this pipe rank, plus what the run does differently (each
    term named). With t tensor-parallel ranks, d replicas, m micro-batches of b rows, an
    activation of A = 4·b·s·h bytes and ``one`` = (t − 1)/t · A:

    tp: the vocabulary-parallel loss reduces three values per token (the logits' maximum,
    the sum of their exponentials, the target's logit: 3 all-reduces of 4·b·s bytes per
    micro-batch), which the planner leaves out. Under sequence parallelism, PyTorch's
    plan keeps the gathered input of each column-parallel layer for its weight gradient,
    where Megatron-LM (and the planner) gathers it again in the backward (2 fewer
    all-gathers per block and micro-batch); the embedding's sum is an all-reduce, each
    rank then keeping its positions (and all-gathering their gradient back), where
    Megatron-LM reduce-scatters it (2 more halves per micro-batch); and the norms'
    weights and biases get their gradients summed over the tp ranks once a step (4 h
    values per block, all-reduced).

    dp: the planner's ``layer_parameters() / t`` splits every parameter of a block over
    the tp ranks; the norms' weights and biases and the row-parallel layers' biases
    (6 h values per block) are whole on each tp rank; and the output projection's bias
    (V / t per rank) is not in the planner's model. The replicas add up their losses on
    the last stage (one 4-byte all-reduce). FSDP: the planner reduce-scatters sharded
    gradients after every micro-batch's backward (ZeRO-2/3 as DeepSpeed runs them); PyTorch's
    pipelining runtime, and this one, accumulate whole gradients through the step and
    reduce-scatter once."""
    layout = layout_of(case)
    planned = communication_bytes(MODEL, GLOO, layout)[pipe_rank]
    tp, pp, dp, _ = case.mesh
    m, h, t, d = case.microbatches, MODEL.hidden, tp, dp
    tokens = layout.micro_batch * MODEL.seq_len
    one = (t - 1) / t * 4 * tokens * h
    ring = {"all_reduce": lambda n, k: 2 * (k - 1) / k * n, "half": lambda n, k: (k - 1) / k * n}
    schedule = build(case.schedule, pp, m, stages_per_rank(case.schedule))
    layers = chunk_layers(MODEL, layout)
    chunks = schedule.stages_on(pipe_rank)
    blocks = sum(layers[c] for c in chunks)
    has_loss, has_embedding = len(layers) - 1 in chunks, 0 in chunks
    extra = dict.fromkeys(("tp", "pp", "dp"), 0.0)
    if has_loss:
        extra["tp"] += m * 3 * ring["all_reduce"](4 * tokens, t)
    if case.sequence_parallel:
        extra["tp"] += m * (2 * one * has_embedding - 2 * one * blocks)
        extra["tp"] += ring["all_reduce"](4 * 4 * h * blocks, t)
    planned_params = sum(chunk_parameters(MODEL, layout, layers)[c] for c in chunks)
    whole_on_tp = 6 * h * (1 - 1 / t) * blocks + MODEL.vocab / t * has_loss
    if d > 1:
        extra["dp"] += ring["all_reduce"](4, d) * has_loss
        if case.data == "ddp":
            extra["dp"] += ring["all_reduce"](4 * whole_on_tp, d)
        else:
            gathers = 2 * m if layout.reshard_after_forward else 1
            extra["dp"] += (gathers + 1) * ring["half"](4 * whole_on_tp, d)
            extra["dp"] -= (m - 1) * ring["half"](4 * planned_params, d)
    return {dim: planned[dim] + extra[dim] for dim in planned}


@pytest.mark.parametrize("name", [c.name for c in worker.CASES if c.traffic])
def test_bytes_on_each_dimension_are_the_planners(job, name):
    """Each rank's bytes per mesh dimension in a steady step (the messages' layouts
    agreed in the step before) equal `plan.communication_bytes` for the case's Layout,
    with the run's differences counted (`expected_bytes`). The model's sizes leave FSDP
    nothing to pad (every dimension it shards divides by dp)."""
    _, records = job
    case = CASES[name]
    for r, record in enumerate(records):
        _, pipe_rank, _ = record[name]["place"]
        got, want = run_bytes(record[name]["messages"]), expected_bytes(case, pipe_rank)
        for dim in want:
            assert math.isclose(got[dim], want[dim], rel_tol=1e-12), \
                f"{name}, rank {r}, {dim}: counted {got[dim]:,.1f} bytes, expected " \
                f"{want[dim]:,.1f} (the planner's {communication_bytes(MODEL, GLOO, layout_of(case))[pipe_rank][dim]:,.1f})"

