"""`DistributedPipe` on ``tp × pp × dp`` meshes computes what one process computes: each
schedule family, the replicas as DDP or FSDP, with and without sequence parallelism,
recompute and dropout; the gradient norm is clipped over all three dimensions; the
training program (``lm.train --tp --sequence-parallel --fsdp``) trains and saves, and
training goes on from its checkpoint on another tp, pp and dp; and the bytes each rank
sends on each mesh dimension are the planner's (`plan.communication_bytes`), the
differences named and counted.

One torchrun job of 8 gloo processes (`three_d_worker.py`) runs every case; the tests
compare each rank's records with this process. The training program's bad flags are
refused before any process starts (no job)."""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

import pytest
import torch

import three_d_worker as worker
from pipeline_lib import run_state
from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.distributed.pipe import check_sequence_splits
from pipeline_lib.lm import train
from pipeline_lib.lm.data import get_batch
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.parallel import rank_order
from pipeline_lib.parallel.block import shardable, unpack_projections
from pipeline_lib.plan import Cluster, Layout, Model, communication_bytes, executor_bytes
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
def job(tmp_path_factory) -> tuple[Path, list[dict], str]:
    """The job's folder, each rank's records, and what it printed."""
    out = tmp_path_factory.mktemp("three_d")
    with pytest.MonkeyPatch.context() as patch:   # the worker is a module of tests/
        patch.setenv("PYTHONPATH", os.pathsep.join((str(REPO), str(REPO / "tests"))))
        output = torchrun("three_d_worker", ["--out", out], nproc=WORLD, timeout=600)
    return out, [torch.load(out / f"rank{r}.pt") for r in range(WORLD)], output


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
    _, records, _ = job
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
    _, records, _ = job
    for name in ("1f1b fsdp sp", "resume tp 4", "resume pp 4 fsdp"):
        tp, pp, dp, order = CASES[name].mesh
        for r, record in enumerate(records):
            coords = rank_order.coordinates(r, order, {"tp": tp, "pp": pp, "dp": dp})
            assert record[name]["place"] == (coords["tp"], coords["pp"], coords["dp"])
    assert [records[r]["1f1b fsdp sp"]["place"] for r in range(4)] == \
        [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    assert [records[r]["resume pp 4 fsdp"]["place"] for r in (1, 4)] == [(0, 1, 0), (0, 0, 1)]


def test_the_norm_is_clipped_over_the_three_dimensions(job):
    """FSDP shards, tensor parallelism splits, the pipeline places: the norm of every
    rank's share together is the whole model's, and every share is scaled as
    `torch.nn.utils.clip_grad_norm_` scales the whole model's gradients."""
    _, records, _ = job
    model = shardable(worker.tiny_lm())
    lm_loss(model(worker.batch()[0]), worker.batch()[1]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP).item()
    clipped = {n: p.grad for n, p in model.named_parameters()}
    assert norm > 2 * worker.CLIP     # the clip bites
    for r, record in enumerate(records):
        got = record["1f1b fsdp sp"]
        assert got["norm"] == pytest.approx(norm, rel=1e-5), f"rank {r}"
        assert_grads(got["clipped"], clipped, f"rank {r}",
                     max(float(g.abs().max()) for g in clipped.values()))


def test_dropout_under_tensor_parallelism(job):
    """With dropout, recomputing every micro-batch replays its masks exactly (the
    sharded regions' own streams included: the same gradients as without recompute);
    the masks do drop (gradients unlike the run without dropout); and every rank of a
    tensor-parallel group computes the same loss."""
    _, records, _ = job
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


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The training program's first training and validation batches."""
    data = argparse.Namespace(synthetic=worker.VOCAB, steps=1, bptt=worker.SEQ,
                              batch=worker.ROWS, seed=0, eval_steps=1)
    source, valid, _ = train._tokens(data, 0)
    return get_batch(source, 0, worker.SEQ), get_batch(valid, 0, worker.SEQ)


def two_steps() -> dict:
    """One process: the training program's step (its first batch, the clipped AdamW
    update; its log's loss and the validation loss after), then the resumed step (batch
    1): the loss, gradients, norm, and the weights after its clipped update."""
    model = shardable(worker.tiny_lm())
    optimizer = torch.optim.AdamW(model.parameters(), lr=worker.LR)
    (first, valid), found = train_data(), {}
    for k, (inputs, target) in enumerate((first, worker.batch(1))):
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), target)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP).item()
        optimizer.step()
        with torch.no_grad():
            valid_loss = lm_loss(model(valid[0]), valid[1]).item()
        found[k] = dict(loss=loss.item(), grads=grads, norm=norm, valid_loss=valid_loss,
                        weights={n: p.detach().clone() for n, p in model.named_parameters()},
                        state={n: t.clone() for n, t in model.state_dict().items()})
    return found


def test_the_training_program_trains_on_three_dimensions(job):
    """``lm.train --tp 2 --pp 2 --dp 2 --fsdp --sequence-parallel``: the loss it logs,
    the gradient norm, the validation loss after the step, and the weights it saved are
    one process's."""
    out, _, output = job
    want = two_steps()[0]
    step = re.search(r"step +1  loss (\S+)  lr \S+  grad norm (\S+)", output)
    valid = re.search(r"valid loss (\S+)", output)
    assert step and valid, output[-3000:]
    assert "2 pipeline ranks x 2 replicas x 2 tensor-parallel ranks, sequence parallel, " \
        "FSDP" in output
    assert float(step[1]) == pytest.approx(want["loss"], abs=6e-4)
    assert float(step[2]) == pytest.approx(want["norm"], abs=6e-4)
    assert float(valid[1]) == pytest.approx(want["valid_loss"], abs=6e-4)
    merged = run_state.merged_state_dict(out / "checkpoint")   # the unpipelined names
    assert merged.keys() == want["state"].keys()
    split = lambda t: list(t.chunk(3))  # noqa: E731
    assert_weights(unpack_projections(merged, split), unpack_projections(want["state"], split),
                   "lm.train's checkpoint")


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   what: str) -> None:
    """Weights after AdamW updates of lr = 0.01 equal within 1e-5: Adam divides each
    gradient by its own root mean square, so a small gradient's rounding moves its
    update by up to ~lr·1e-3. The key projection's bias is left out: its gradient is
    zero in exact arithmetic, and Adam normalises the rounding noise into an update of
    order lr."""
    for n, w in got.items():
        if not n.endswith("k_proj.bias"):
            torch.testing.assert_close(w, want[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{what}: {n}: {m}")


@pytest.mark.parametrize("name", [c.name for c in worker.CASES if c.resume])
def test_training_goes_on_from_a_checkpoint_on_another_layout(job, name):
    """The run resumes the training program's checkpoint (2 × 2 × 2, FSDP, sequence
    parallel) on another tp, pp and dp (FSDP on or off), steps, clips and updates: the
    same loss, gradients, norm and weights as one process's two steps. Adam's moments
    are restored: without them the second update would differ (its bias correction and
    its normalisation); so is their step count, one per parameter (the query, key and
    value projections share one in the checkpoint)."""
    _, records, _ = job
    want = two_steps()[1]
    scale = max(float(g.abs().max()) for g in want["grads"].values())
    for r, record in enumerate(records):
        got = record[name]
        assert got["done"] == 1
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
        if got["loss"] is not None:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert_grads(got["grads"], want["grads"], f"{name}, rank {r}", scale)
        assert_weights(got["weights"], want["weights"], f"{name}, rank {r}")
    covered(records, name, want["grads"])


@pytest.mark.parametrize("flags, says", [
    (["--sequence-parallel"], "--sequence-parallel splits each stage's positions over the "
                              "tensor-parallel ranks: give --tp 2 or more"),
    (["--tp", "2", "--sequence-parallel", "--bptt", "35"], "--bptt 35 does not divide by 2"),
    (["--fsdp"], "--fsdp shards the weights over the data-parallel replicas: give --dp 2"),
    (["--dp", "2", "--no-reshard-after-forward"], "choose what FSDP does with the weights "
                                                  "it gathered: add --fsdp"),
    (["--tp", "3"], "--tp 3 cannot split the cpu preset's 4 heads"),
    (["--tp", "0"], "must be a whole number of at least 1, not '0': 1 keeps every layer whole"),
])
def test_the_training_programs_three_d_flags_are_checked(flags, says, capsys):
    with pytest.raises(SystemExit):
        train.main(flags)
    assert says in capsys.readouterr().err


def test_sequence_parallelism_refuses_positions_it_cannot_split():
    check_sequence_splits(torch.zeros(2, 8, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="have 7 \\(dimension 1\\), which does not divide by 2"):
        check_sequence_splits((torch.zeros(2, 7),), 2)


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
                  reshard_after_forward=not sharded or (case.data == "fsdp" and not split))


@pytest.mark.parametrize("name", [c.name for c in worker.CASES if c.traffic])
def test_bytes_on_each_dimension_are_the_planners(job, name):
    """Each rank's bytes per mesh dimension in a steady step (the messages' layouts
    agreed in the step before) equal `plan.communication_bytes` for the case's Layout,
    with the executor's differences counted (`plan.communication.executor_bytes`). The
    model's sizes leave FSDP nothing to pad (every dimension it shards divides by dp).
    (Notebook 08 counts DDP without sequence parallelism against the same function, and
    bench/bench_three_d.py all four.)"""
    _, records, _ = job
    layout = layout_of(CASES[name])
    planned = communication_bytes(MODEL, GLOO, layout)
    want = executor_bytes(MODEL, GLOO, layout)
    for r, record in enumerate(records):
        _, pipe_rank, _ = record[name]["place"]
        for dim in ("tp", "pp", "dp"):
            got = record[name]["sent"].get(dim, 0.0)
            assert math.isclose(got, want[pipe_rank][dim], rel_tol=1e-12), \
                f"{name}, rank {r}, {dim}: counted {got:,.1f} bytes, expected " \
                f"{want[pipe_rank][dim]:,.1f} (the planner's {planned[pipe_rank][dim]:,.1f})"
