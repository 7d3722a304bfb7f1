"""microbatch.py: 1-D tensors (class labels) are split and gathered like any batch; 0-d
tensors are shared; the error messages say what to do.

Written against the mutants `make mutants` found alive (see mutants-equivalent.md).
"""
import pytest
import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.microbatch import NoChunk, gather, split


def test_1d_labels_are_split_with_their_rows_and_gathered_back():
    x = torch.arange(20.0).reshape(10, 2)
    labels = torch.arange(10) * 10  # one class label per row: the README's example

    parts = split((x, labels), 4)

    assert [p[1].tolist() for p in parts] == [[0, 10, 20], [30, 40, 50], [60, 70], [80, 90]]
    for rows, label in parts:  # each micro-batch gets its own rows' labels, no others
        assert torch.equal(rows[:, 0] * 5, label.float())
    assert torch.equal(gather([p[1] for p in parts]), labels)
    assert torch.equal(gather(split(labels, 3)), labels)


def test_1d_outputs_of_every_microbatch_are_gathered():
    outputs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([4.0, 5.0])]
    assert gather(outputs).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert gather([(o, o * 2) for o in outputs])[1].tolist() == [2.0, 4.0, 6.0, 8.0, 10.0]


def test_a_0d_tensor_in_the_batch_goes_whole_to_every_microbatch():
    x, temperature = torch.randn(6, 3), torch.tensor(0.5)
    parts = split((x, temperature), 3)
    assert [p[0].size(0) for p in parts] == [2, 2, 2]
    assert all(p[1] is temperature for p in parts)


def test_0d_outputs_are_refused_not_silently_reduced_to_the_first():
    # Found by a mutant of the old gather, which returned micro-batch 0's 0-d output and
    # dropped the others: pipe(x) of a model ending in x.sum() gave the first micro-batch's.
    with pytest.raises(ValueError, match="returned a 0-dim tensor"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(ValueError, match="returned a 0-dim tensor"):
        gather([(torch.ones(2), torch.tensor(1.0)), (torch.ones(2), torch.tensor(2.0))])
    model = nn.Sequential(nn.Linear(2, 2), Sum())
    with pytest.raises(ValueError, match="returned a 0-dim tensor"):
        Pipe(model, chunks=2)(torch.randn(4, 2))


class Sum(nn.Module):
    def forward(self, x):
        return x.sum()


def test_error_messages_are_exact():
    with pytest.raises(TypeError) as info:
        NoChunk([1, 2])
    assert str(info.value) == "NoChunk wraps a tensor, got list"
    with pytest.raises(TypeError) as info:
        split((torch.tensor(1.0), "flag"), 2)  # a 0-d tensor has no batch dimension
    assert str(info.value) == (
        "the batch has no tensor to split along dim 0 (got tuple of (Tensor, str)); pass a "
        "tensor, or a tuple, list or dict holding at least one tensor with a batch dimension "
        "(torch.tensor(...) turns a list of numbers into one; wrap tensors shared by all rows "
        "in NoChunk)")
    with pytest.raises(ValueError) as info:
        split(torch.zeros(4, 2), 0)
    assert str(info.value) == "microbatches must be an int >= 1, got 0"


def test_gather_names_what_differs_between_microbatches():
    with pytest.raises(ValueError) as info:
        gather([(torch.ones(2), 1), [torch.ones(2)]])
    assert str(info.value) == ("the outputs of micro-batches 0 and 1 are structured "
                               "differently (tuple of (Tensor, int) vs list of (Tensor)); a "
                               "stage must return the same containers for every micro-batch")
    with pytest.raises(ValueError) as info:
        gather([torch.ones(2), torch.ones(2), "oops"])
    assert str(info.value) == ("the last stage returned a tensor for micro-batch 0 but a "
                               "str for another, in the same place")
