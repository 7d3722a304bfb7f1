"""Skip connections across processes, and what a steady `DistributedPipe` step costs the
host: gradients equal the unpipelined model's on 2 and 3 processes for a fill-drain, a
1F1B, an interleaved, a V and a zero-bubble schedule, skips joining ranks that are not
neighbours included; a step whose batch has an earlier step's shapes reads nothing on
the host per message or per micro-batch; autocast or a `NoChunk` input switched on
between two steps changes the agreed layouts; a stalled peer is named within the
timeout. Three torchrun launches (`dist_skip_worker.py`), and the classic `sync.Pipe`'s
skips across its stage threads, in this process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_skip_worker as worker
from pipeline_lib import sync
from test_distributed import failing_run, torchrun


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(nproc)`` -> the folder of the launch on ``nproc`` processes: the skip
    schedules on both, the host reads and the autocast steps on 2 too."""
    folders = {}

    def folder(nproc: int):
        if nproc not in folders:
            out = tmp_path_factory.mktemp(f"skips{nproc}")
            scenarios = "skips,hostreads,autocast" if nproc == 2 else "skips"
            done, _ = torchrun(nproc, "--scenarios", scenarios, "--out", str(out),
                               worker="dist_skip_worker.py")
            assert done.returncode == 0, done.stdout + done.stderr
            folders[nproc] = out
        return folders[nproc]
    return folder


def unpipelined() -> tuple[float, dict[str, torch.Tensor]]:
    model = worker.skip_model()
    inputs, target = worker.batch()
    loss = F.mse_loss(model(inputs), target)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", worker.SCHEDULES)
@pytest.mark.parametrize("nproc", [2, 3])
def test_skips_across_processes_give_the_unpipelined_gradients(launched, nproc, name):
    ranks = [torch.load(launched(nproc) / f"skips-{name}-rank{r}.pt") for r in range(nproc)]
    loss, grads = unpipelined()
    holder = next(r for r in ranks if r["loss"] is not None)   # the last stage's rank
    assert holder["loss"] == pytest.approx(loss, rel=1e-5)
    got = {n: g for r in ranks for n, g in r["grads"].items()}
    assert got.keys() == grads.keys() and sum(len(r["grads"]) for r in ranks) == len(grads)
    for n, g in got.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_skip_gets_a_channel_between_ranks_that_are_not_neighbours(launched):
    """On 3 ranks, 1F1B's and ZB-V's activations only join 0-1 and 1-2; a skip from rank
    0 to rank 2 (1F1B's outer one, ZB-V's inner one) joins them, both ways (its gradient
    comes back)."""
    for name in ("1f1b", "zb_v"):
        pairs = torch.load(launched(3) / f"skips-{name}-rank0.pt")["pairs"]
        assert {(0, 2), (2, 0)} <= set(pairs), (name, pairs)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_a_steady_step_reads_nothing_on_the_host_per_message_or_micro_batch(launched, name):
    """The second step of a batch's shapes sends no layout and reads no header: at 2 and
    4 micro-batches (twice the messages), each rank reads the same, only the step's
    all-reduces read back (`devices.read_back`: the agreement on seed and shapes, and on
    the loss's kind and count; on the last stage also the loss's count) and rank 0's seed
    drawn from the CPU's generator (`rng.py`); nothing in the transport, the executor,
    the lowering or the loss."""
    for rank in range(2):
        counts = torch.load(launched(2) / f"hostreads-rank{rank}.pt")
        assert counts[(name, 2)] == counts[(name, 4)], (rank, counts)
        sites = counts[(name, 2)]
        assert {site.partition(" ")[0] for site in sites} <= {
            "pipeline_lib/devices.py", "pipeline_lib/rng.py"}, (rank, sites)
        assert sum(sites.values()) <= 4, (rank, sites)


def test_autocast_or_a_whole_mask_switched_on_between_steps_agrees_new_layouts(launched):
    """The same batch under autocast sends bfloat16 messages, and a mask given whole
    (`NoChunk`) instead of split travels at its full size: each a new layout, though the
    batch's shapes did not change. The old batch key ignored both: ProtocolError."""
    losses = torch.load(launched(2) / "autocast-rank1.pt")
    inputs, target = worker.batch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(worker.WIDTH, worker.WIDTH)
                                  for _ in range(2)))
    with torch.no_grad():
        plain = F.mse_loss(model(inputs), target).item()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = F.mse_loss(model(inputs), target).item()
    assert losses[0] == pytest.approx(plain, rel=1e-5)
    assert losses[1] == pytest.approx(mixed, rel=1e-2) and losses[1] != losses[0]
    assert losses[2] == pytest.approx(losses[3], rel=1e-6)


def test_a_stalled_peer_is_named_within_the_timeout():
    """Rank 1 stalls for 90 s in its second step's first forward; rank 0, waiting for
    the first gradient (a receive posted early), gives up after the mesh's 10 s and says
    what it waited for, from whom, and which action needed it."""
    output = failing_run(2, "--scenarios", "timeout", "--timeout", "10",
                         worker="dist_skip_worker.py", within=worker.STALL)
    assert ("rank 0 was receiving the gradient for stage 0, micro-batch 0 from rank 1, "
            "which 0B0 needs (waits time out after 10 s)") in output
    assert "while running 0B0 of GPipe" in output


@pytest.mark.parametrize("name", worker.SCHEDULES)
def test_classic_pipe_sends_skips_across_its_ranks(name):
    """`sync.Pipe` makes each top-level child on the CPU a stage, here a thread per rank:
    the skips go from the stashing rank to the popping one (on one rank where a V's or
    an interleaved rank's stages hold both ends)."""
    loss, grads = unpipelined()
    model = worker.skip_model()
    pipe = sync.Pipe(model, chunks=worker.MICROBATCHES)
    inputs, target = worker.batch()
    torch.testing.assert_close(pipe.step(inputs, target, F.mse_loss, name).item(), loss,
                               rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)
