"""`pipeline_lib.sync.microbatch` (the classic batch rules) and the `Presplit` batches it
hands to the core `microbatch.split`."""
import pytest
import torch

from pipeline_lib import tree
from pipeline_lib.microbatch import NoChunk, Presplit, split
from pipeline_lib.sync.microbatch import check, scatter


def test_split_hands_presplit_micro_batches_on_as_they_are():
    parts = (torch.ones(3, 2), torch.ones(1, 2))      # uneven: split would never make it
    batches = split(Presplit(parts), 4)
    assert isinstance(batches, list) and len(batches) == 2
    assert all(a is b for a, b in zip(batches, parts))
    # a tuple, so tree (which the executor uses to find the inputs' tensors) sees them
    assert len(tree.tensors(Presplit(parts))) == 2


def test_one_tensor_is_chunked():
    x = torch.arange(10.0)
    assert [len(p) for p in scatter((x,), 4)] == [3, 3, 3, 1]
    assert all(isinstance(p, torch.Tensor) for p in scatter((x,), 4))


def test_several_inputs_make_one_tuple_per_micro_batch():
    a, c, shared = torch.arange(6.0), torch.arange(3.0), torch.ones(2)
    w = [torch.zeros(5)]
    batches = scatter((a, "flag", NoChunk(shared), c, w), 3)
    assert len(batches) == 3
    for k, (ak, flag, sk, ck, wk) in enumerate(batches):
        assert ak.tolist() == [2.0 * k, 2.0 * k + 1] and ck.tolist() == [float(k)]
        assert flag == "flag" and sk is shared and wk is w


def test_inputs_making_different_chunk_counts_are_refused():
    with pytest.raises(RuntimeError, match="different number of chunks produced for "
                                           "inputs: 3 and 4"):
        scatter((torch.ones(3), torch.ones(4)), 5)


def test_check_wants_a_top_level_tensor_on_the_first_device():
    check(torch.device("cpu"), (torch.ones(1), [1]))
    with pytest.raises(TypeError, match=r"got \(list, str\)"):
        check(torch.device("cpu"), ([torch.ones(1)], "x"))
    with pytest.raises(TypeError, match=r"got \(nothing\)"):
        check(torch.device("cpu"), ())
    with pytest.raises(ValueError, match="first stage's device meta, got one on cpu"):
        check(torch.device("meta"), (torch.ones(1),))
