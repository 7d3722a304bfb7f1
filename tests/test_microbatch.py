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
                                         "micro-batches; use at most 3 micro-batches"):
        split(torch.zeros(3, 2), 4)


def test_inconsistent_batch_sizes_and_missing_tensors():
    with pytest.raises(ValueError, match=r"disagree on the batch size .* \[3, 4\]"):
        split((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(TypeError, match="no tensor to split"):
        split(("a", 1), 2)
    with pytest.raises(TypeError, match="NoChunk wraps a tensor"):
        NoChunk([1, 2])


def test_loss_weights_rebuild_the_batch_mean_for_uneven_splits():
    x = torch.randn(10, generator=torch.Generator().manual_seed(0)) + 1   # mean far from 0
    parts = split(x, 4)  # 3, 3, 2, 2 rows
    weights = loss_weights(parts)
    assert sum(weights) == pytest.approx(1.0)
    rebuilt = sum(w * p.mean() for w, p in zip(weights, parts))
    assert rebuilt == pytest.approx(x.mean().item(), rel=1e-6)


def test_trees_are_split_leaf_by_leaf_and_gathered_back():
    x, ids, mask = torch.randn(6, 2), torch.arange(6), torch.ones(3, 3)
    batch = {"x": x, "more": [ids, (NoChunk(mask), None, 0.5)]}
    parts = split(batch, 3)
    assert [p["x"].size(0) for p in parts] == [2, 2, 2]
    assert all(p["more"][1][0] is mask and p["more"][1][1:] == (None, 0.5) for p in parts)
    assert isinstance(parts[0]["more"], list) and isinstance(parts[0]["more"][1], tuple)
    gathered = gather([{"x": p["x"], "more": [p["more"][0], None]} for p in parts])
    assert torch.equal(gathered["x"], x) and torch.equal(gathered["more"][0], ids)
    assert gathered["more"][1] is None


def test_gather_refuses_what_has_no_well_defined_join():
    """A per-micro-batch scalar (a mean, a count) cannot be joined into the batch's value;
    the old code silently returned micro-batch 0's."""
    parts = split(torch.randn(6, 2), 3)
    with pytest.raises(ValueError, match="0-dim tensor: one value for a whole micro-batch"):
        gather([p.pow(2).mean() for p in parts])
    with pytest.raises(ValueError, match="Python int .* cannot tell whether it is a count"):
        gather([(p, p.size(0)) for p in parts])
    with pytest.raises(ValueError, match="'a' for micro-batch 0 but 'b' for another"):
        gather([(parts[0], "a"), (parts[1], "b")])
    with pytest.raises(ValueError, match="structured differently"):
        gather([{"a": parts[0]}, {"b": parts[1]}])
    assert gather([(p, True) for p in parts])[1] is True


def test_a_batch_without_a_tensor_names_what_it_got():
    with pytest.raises(TypeError, match=r"no tensor to split along dim 0 \(got list of "
                                        r"\(int\)\).*torch.tensor"):
        split([0, 1, 2], 2)


def test_inputs_and_target_rows_must_match():
    from pipeline_lib.microbatch import check_rows
    with pytest.raises(ValueError, match="the inputs have 8 rows .* but the target has 4"):
        check_rows({"x": torch.zeros(8, 2)}, torch.zeros(4))
    check_rows((torch.zeros(8, 2), NoChunk(torch.zeros(3))), [torch.zeros(8)])


def test_an_empty_batch_is_named_as_empty():
    """It said "use chunks <= 0"."""
    with pytest.raises(ValueError, match="the batch has 0 rows .* nothing to split into 2 "
                                         "micro-batches; pass at least 2 rows"):
        split(torch.zeros(0, 3), 2)


@pytest.mark.parametrize("target", [None, 3, torch.tensor(1.0)])
def test_a_step_without_a_target_of_rows_says_so(target):
    """step(x, None, loss_fn) talked about "the batch", which the caller took for x."""
    from pipeline_lib.microbatch import check_rows
    with pytest.raises(TypeError, match=r"the target has no tensor to split along dim 0 "
                                        r"\(got \w+\).*pass a target tensor with 8 rows.*"
                                        r"pipe\(inputs\)"):
        check_rows(torch.zeros(8, 2), target)


def test_micro_batches_are_independent_tensors():
    """Views of one batch share its version counter: an in-place change to one micro-batch
    invalidated what autograd saved of the others."""
    x = torch.randn(6, 2, requires_grad=True)
    parts = split(x * 1, 3)
    versions = [p._version for p in parts]
    parts[1].add_(1)
    assert [p._version for p in parts] == [versions[0], versions[1] + 1, versions[2]]
    sum(p.sum() * (k + 1) for k, p in enumerate(parts)).backward()    # still linked to x
    assert torch.equal(x.grad, torch.tensor([[1.0] * 2] * 2 + [[2.0] * 2] * 2 + [[3.0] * 2] * 2))


def inplace_first_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6), nn.Linear(6, 3))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("balance", [[2, 1], [1, 2]])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_inplace_first_layer_on_stage_0(balance, schedule, checkpoint):
    """nn.ReLU(inplace=True) as the model's first layer failed 5 times in 5 with [2, 1]
    (and by thread timing with [1, 2]): the micro-batches shared a version counter."""
    from conftest import assert_same_grads
    from pipeline_lib import Pipe
    from workloads import data
    x, y = data(12)
    reference = inplace_first_model()
    expected = torch.nn.functional.cross_entropy(reference(x.clone()), y)
    expected.backward()
    model = inplace_first_model()
    leaf = x.clone().requires_grad_()
    input_grad, = torch.autograd.grad(
        torch.nn.functional.cross_entropy(inplace_first_model()(leaf * 1), y), leaf)
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=balance)
    kept = x.clone()
    for _ in range(10):                     # the failure depended on the threads' timing
        model.zero_grad()
        loss = pipe.step(x, y, torch.nn.CrossEntropyLoss(), schedule)
        torch.testing.assert_close(loss, expected.detach())
        assert_same_grads(model, reference)
        model.zero_grad()
        torch.nn.functional.cross_entropy(pipe(x), y).backward()
        assert_same_grads(model, reference)
        leaf = x.clone().requires_grad_()
        torch.nn.functional.cross_entropy(pipe(leaf * 1), y).backward()
        torch.testing.assert_close(leaf.grad, input_grad)
    assert torch.equal(x, kept)             # the caller's batch is left as it was


@pytest.mark.parametrize("chunks", [True, 2.0])
def test_chunks_must_be_an_int(chunks):
    """tensor_split's own error listed its overloads."""
    with pytest.raises(ValueError, match=r"microbatches must be an int >= 1, got (True|2.0)"):
        split(torch.zeros(4, 2), chunks)


def test_the_old_keyword_chunks_still_splits_and_names_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"split\(chunks=\.\.\.\).*microbatches="):
        parts = split(torch.arange(6), chunks=3)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
