"""Micro-batching: splits cover the batch exactly, and the loss weights rebuild its mean."""
import pytest
import torch

from pipeline_lib.microbatch import NoChunk, gather, loss_weights, split


@pytest.mark.parametrize("rows,chunks", [(8, 4), (10, 4), (5, 5), (7, 1), (9, 2)])
def test_split_then_gather_is_identity(rows, chunks):
    x = torch.arange(rows * 3).reshape(rows, 3)
    parts = split(x, chunks)
    assert len(parts) == chunks
    assert max(p.size(0) for p in parts) - min(p.size(0) for p in parts) <= 1
    assert torch.equal(gather(parts), x)


def test_tuples_nochunk_and_plain_values_are_replicated():
    x, mask = torch.randn(6, 2), torch.ones(4, 4)
    parts = split((x, NoChunk(mask), "flag"), 3)
    assert [p[0].size(0) for p in parts] == [2, 2, 2]
    assert all(p[1] is mask and p[2] == "flag" for p in parts)
    gathered = gather([(p[0], p[2]) for p in parts])
    assert torch.equal(gathered[0], x) and gathered[1] == "flag"


def test_batch_smaller_than_chunks_is_a_clear_error():
    with pytest.raises(ValueError, match="a batch of 3 rows cannot be split into 4 "
                                         "micro-batches; use chunks <= 3"):
        split(torch.zeros(3, 2), 4)


def test_inconsistent_batch_sizes_and_missing_tensors():
    with pytest.raises(ValueError, match=r"disagree on the batch size .* \[3, 4\]"):
        split((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(TypeError, match="no tensor to split"):
        split(("a", 1), 2)
    with pytest.raises(TypeError, match="NoChunk wraps a tensor"):
        NoChunk([1, 2])


def test_loss_weights_rebuild_the_batch_mean_for_uneven_splits():
    x = torch.randn(10)
    parts = split(x, 4)  # 3, 3, 2, 2 rows
    weights = loss_weights(parts)
    assert sum(weights) == pytest.approx(1.0)
    rebuilt = sum(w * p.mean() for w, p in zip(weights, parts))
    assert rebuilt == pytest.approx(x.mean().item(), rel=1e-6)
