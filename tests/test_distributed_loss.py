"""DistributedPipe with token-weighted losses and tree activations, in real processes:
`dist_loss_worker.py` runs each case under torchrun; this process compares what every
rank computed with unpipelined training. One launch per mesh (2 and 4 processes)."""
from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import dist_loss_worker as worker
from pipeline_lib.distributed.launch import torchrun
from workloads import padded_batch, token_mean, token_model, tree_batch, tree_model

TESTS = Path(__file__).resolve().parent
CASES = [(mesh, case) for mesh, cases in worker.CASES.items() for case in cases]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(mesh)`` -> every rank's saved cases, launching the mesh on first use."""
    launched: dict[str, list[dict]] = {}

    def ranks(mesh: str) -> list[dict]:
        if mesh not in launched:
            out = tmp_path_factory.mktemp(mesh)
            pp, dp = (int(n) for n in mesh.split("x"))
            path = os.pathsep.join([str(TESTS.parent), str(TESTS)])
            with mock.patch.dict(os.environ, {"PYTHONPATH": path}):
                torchrun("dist_loss_worker", ["--mesh", mesh, "--out", out], nproc=pp * dp,
                         timeout=150)
            launched[mesh] = [torch.load(out / f"{mesh}-rank{r}.pt") for r in range(pp * dp)]
        return launched[mesh]
    return ranks


def unpipelined(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    if kind == "tree":
        model = tree_model()
        inputs, target = tree_batch()
        loss = F.cross_entropy(model(inputs), target)
    else:
        model = token_model()
        inputs, target = padded_batch()
        loss = token_mean(model(inputs), target)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh,case", CASES)
def test_every_replica_gets_the_token_weighted_loss_and_gradients(results, mesh, case):
    """(loss_sum, count) pairs: the gradients are Σ over all tokens / all tokens, the
    count summed over micro-batches and replicas, the same on every stage."""
    kind = case.partition("-")[0]
    loss, grads = unpipelined(kind)
    ranks = results(mesh)
    pp = int(mesh.split("x")[0])
    for replica in (ranks[d:d + pp] for d in range(0, len(ranks), pp)):
        assert replica[-1][case]["loss"] == pytest.approx(loss, rel=1e-5)
        assert all(r[case]["loss"] is None for r in replica[:-1])
        got = {n: g for r in replica for n, g in r[case]["grads"].items()}
        assert got.keys() == grads.keys()
        for n, g in got.items():
            expected = grads[n] + worker.EARLIER if kind == "accumulate" else grads[n]
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6, msg=n)
