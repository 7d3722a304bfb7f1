"""Round 4 of the hostile user (issue 35): one test per bug that `hostile_round4.py` (the
reusable case script: ``python tests/hostile_round4.py``) found; the two-process ones run in
`test_round4.py`'s launch (`dist_round4_worker.py`). The cases tried, and their outcomes
before the fixes (ok: the right answer or the clear error expected):

| area | cases | not ok before |
|---|---|---|
| input gradients (item 4's neighbours) | accumulating over steps; a failed step; one stage; an in-place first layer; bf16 autocast; one tensor twice in the inputs; an input stage 0 ignores; `sync.Pipe.step`; token ids; `DistributedPipe` with checkpointing on ZB-V; `pipe(x)` with checkpointing; a view of a leaf | none |
| `sync.Pipe` in DDP (item 1's) | `LocalRRef` copied and pickled; `gradient_as_bucket_view`; `static_graph` with `no_sync` (from the second step: PyTorch's DDP fails an internal assert on the plain model too when the first is in `no_sync`); `find_unused_parameters` with a non-tensor output, and with one of two outputs used | none |
| clipping (item 2's) | `max_norm` inf; no gradient; bf16 with fp32 gradients; NaN with `error_if_nonfinite` on threads; norm -inf; the 1-norm with NaN on rank 1; inf on rank 0 and NaN on rank 1; a frozen stage on rank 1 | none |
| checkpoints (items 3, 5, 10's) | step 0; an infinite `exp_avg_sq`; bf16 weights holding inf; BatchNorm's integer buffers; AdamW resumed with `amsgrad`; SGD's momentum; an extra empty group; the old format (rank 0's groups in run.pt); no state yet; a balance that is not the pipe's; a file named like a step folder; `latest` naming a folder gone; a full disk writing `latest`; the optimizer None (save, resume); a rank that never calls save | `amsgrad`: KeyError at the first step; the balance: silently saved under other layers' names; full disk on `latest`: no path; `save(optimizer=None)`: AttributeError; no save on one rank: gloo's timeout alone |
| `lm.train` (items 3, 10's) | `--skip-nonfinite` -1 and "two"; `--seed` -1 and 2**64 - 2; a NaN loss at step 1 without `--save`; `--steps` 10**12 | `--steps 10**12` built a list of 10**12 starts (a regression of this round, before it merged) |
| the ranks' batches (item 9's) | NaN on both ranks; a `NoChunk` mask of other values; int32 against int64; a string flag that differs; non-contiguous, same values; rows in another order; the fingerprint of odd tensors (0-dim, empty, bool, fp16, complex, conjugated; a sign flipped) | the string flag: trained without a word; the fingerprint (new this round): a conjugate crashed it, negated values went unseen |
| threads (item 7's) | a forward from another thread during a step; two threads' backwards; a step starting during a backward; `pipe(x)`'s backward inside the step's `loss_fn` (plain; with skip connections and checkpointing; with a weight tied across stages); deepcopy and `torch.save`; a Pipe pickled before this round | `loss_fn`: hung (a wait of this round, before it merged); the old pickle: AttributeError |
| `make lab` (item 8's) | `--ServerApp.port=0`; `=-1`; an empty `JUPYTER_PORT`; `--port 9000` with `--ServerApp.port=99999`; `--ServerApp.port_retries=0` | none |
"""
from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline_lib import Pipe, run_state
from pipeline_lib.distributed import DistributedPipe


def trained(mesh, optimizer=torch.optim.AdamW):
    """A one-rank V pipeline of 4 Linear layers after one step."""
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), mesh,
                           [2, 2], 2, "zb_v")
    opt = optimizer(pipe.parameters())
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    opt.step()
    return pipe, [2, 2], opt


@pytest.fixture
def saved(one_rank_mesh, tmp_path):
    run_state.save(tmp_path, 1, *trained(one_rank_mesh))
    return tmp_path


def test_resuming_with_settings_that_need_more_state_is_refused_naming_it(one_rank_mesh,
                                                                            saved):
    """AdamW(amsgrad=True) resumed from a run without it raised KeyError
    'max_exp_avg_sq' at its first step."""
    amsgrad = lambda params: torch.optim.AdamW(params, amsgrad=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"state of 0.weight has no \['max_exp_avg_sq'\], "
                                         r"which this AdamW's settings need"):
        run_state.resume(saved, *trained(one_rank_mesh, amsgrad))


def test_a_balance_that_is_not_the_pipes_is_refused(one_rank_mesh, tmp_path):
    """It named the stages' tensors by the wrong layers (stage 1's first layer as layer 1
    for balance [1, 3]) and saved them so, without a word."""
    pipe, _, opt = trained(one_rank_mesh)
    with pytest.raises(ValueError, match=r"balance \[1, 3\] is not the one this pipe was "
                                         r"built with .*stage\(s\) 0 hold\(s\) 2 layer\(s\)"):
        run_state.save(tmp_path, 1, pipe, [1, 3], opt)
    assert not list(tmp_path.iterdir())


def test_a_full_disk_while_moving_latest_names_the_file(one_rank_mesh, saved, monkeypatch):
    """The marker's write said "[Errno 28] No space left on device": no file, no fix."""
    real_replace = os.replace

    def full(src, dst):
        if os.path.basename(dst) == run_state.LATEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match=f"no space left to save {saved / run_state.LATEST}"):
        run_state.save(saved, 2, *trained(one_rank_mesh))
    monkeypatch.undo()
    assert (saved / run_state.LATEST).read_text() == "step-000001"


@pytest.mark.parametrize("call", ["save", "resume"])
def test_an_optimizer_that_is_not_one_is_named(one_rank_mesh, saved, call):
    """save(..., None) raised AttributeError: 'NoneType' object has no attribute 'state'."""
    pipe, balance, _ = trained(one_rank_mesh)
    args = (saved, 2, pipe, balance, None) if call == "save" else (saved, pipe, balance, None)
    with pytest.raises(TypeError, match="run_state needs the run's optimizer .* got NoneType"):
        getattr(run_state, call)(*args)


def test_a_save_that_other_ranks_never_join_says_so(one_rank_mesh, tmp_path, monkeypatch):
    """A rank saving alone waited the whole timeout, then said only gloo's words."""
    def timed_out(*args, **kwargs):
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    pipe, balance, opt = trained(one_rank_mesh)
    monkeypatch.setattr(dist, "all_reduce", timed_out)
    with pytest.raises(RuntimeError, match="Timed out") as raised:
        run_state.save(tmp_path, 1, pipe, balance, opt)
    assert "run_state.save waited for every rank" in raised.value.__notes__[0]


def test_a_pipe_pickled_before_this_round_steps():
    """Without the step's new bookkeeping in its state, step raised AttributeError."""
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1])
    state = {k: v for k, v in pipe.__dict__.items() if k not in ("_held", "_backwards")}
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    old.step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    assert all(p.grad is not None for p in old.parameters())


def test_the_batch_fingerprint_sees_conjugates_and_sign_flips():
    """The ranks' batches are compared by `_fingerprint`: a conjugated complex input
    crashed it (view_as_real of a lazy conjugate), and sign flips in pairs (a target
    negated on one rank) wrapped to no change in its sums of the values' bits."""
    from pipeline_lib.distributed.pipe import _fingerprint
    z, y = torch.randn(4, 2, dtype=torch.cfloat), torch.randn(4, 6)
    assert _fingerprint(z.conj()) == _fingerprint(z.conj().resolve_conj())
    assert _fingerprint(z.conj()) != _fingerprint(z)
    assert _fingerprint(-y) != _fingerprint(y)
    assert _fingerprint((y, "train")) != _fingerprint((y, "eval"))
