"""`pipeline_lib.sync` keeps the classic ``torch.distributed.pipeline.sync`` behaviours,
each test naming the classic behaviour it reproduces and, where there was one, the test
of PyTorch's old suite (``test/distributed/pipeline/sync/``, PyTorch <= 2.3) that
checked it. The core `pipeline_lib.Pipe`'s own rules are tested in test_pipe*.py; where
both are shown here, it is to prove the facade's rule is its own.
"""
import copy
import time

import pytest
import torch
from torch import nn

import pipeline_lib
from pipeline_lib import batchnorm
from pipeline_lib.sync import NoChunk, Pipe, WithDevice
from pipeline_lib.sync.balance import balance_by_time
from pipeline_lib.sync.batchnorm import DeferredBatchNorm
from pipeline_lib.sync.skip import SkipError, skippable, verify_skippables


def run(pipe, *inputs):
    return pipe(*inputs).local_value()


# -- 1. micro-batch sizes: torch.chunk -----------------------------------------------------

def test_batch_norm_trains_on_six_rows_in_four_chunks():
    """torch.chunk gives 6 rows / 4 → three micro-batches of 2, so a training BatchNorm1d
    sees 2 rows each; tensor_split's 2, 2, 1, 1 would give it one row, which BatchNorm
    refuses in training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    plain = copy.deepcopy(model)
    x = torch.randn(6, 3)
    out = run(Pipe(model, chunks=4), x)
    torch.testing.assert_close(out, torch.cat([plain(part) for part in x.chunk(4)]))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        pipeline_lib.Pipe(copy.deepcopy(plain), chunks=4)(x)


# -- 2. forward(*inputs): only top-level tensors are split --------------------------------

class AddWeights(nn.Module):
    def forward(self, x, ws):
        return x + ws[0].sum(0)


def test_a_list_of_tensors_goes_whole_to_every_micro_batch():
    """The classic scatter split top-level tensors only; a list (of tensors too) was
    replicated into every micro-batch, so each sees the whole ``w``."""
    x, w = torch.randn(6, 3), torch.randn(4, 3, requires_grad=True)
    model = nn.Sequential(AddWeights(), nn.Linear(3, 3))
    out = run(Pipe(model, chunks=3), x, [w])
    expected = model[1](x + w.sum(0))
    torch.testing.assert_close(out, expected)
    # w gets the gradient of every micro-batch's use of it
    grad, = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), w)[0])


@pytest.mark.parametrize("inputs", [
    lambda a, b: ((a, (a, b)),),           # test_nested_input
    lambda a, b: ((a, [a, b]),),           # test_nested_input
    lambda a, b: ([a, b], [a, b]),         # test_multi_sequence_input
    lambda a, b: ("hello", True),          # test_non_tensor_sequence
], ids=["tuple", "tuple-of-list", "lists", "no-tensor"])
def test_inputs_without_a_top_level_tensor_are_refused(inputs):
    """microbatch.check: at least one argument must itself be a tensor (the classic
    tests named in the parameters)."""
    a, b = torch.rand(10, 1), torch.rand(10, 1)
    with pytest.raises(TypeError, match="needs at least one tensor among its arguments"):
        Pipe(nn.Sequential(nn.Identity()), chunks=2)(*inputs(a, b))


class Both(nn.Module):
    def forward(self, a, b, c):
        return a, b, c


def test_tensors_of_different_lengths_are_chunked_each_on_its_own():
    """The classic test_uneven_batch_size: 3 rows and 6 rows in 5 chunks make three
    pieces each (1 row, 2 rows); the non-tensor comes back once per micro-batch."""
    a, c = torch.rand(3, 10), torch.rand(6, 10)
    out_a, bs, out_c = run(Pipe(nn.Sequential(Both()), chunks=5), a, 7, c)
    torch.testing.assert_close(out_a, a)
    torch.testing.assert_close(out_c, c)
    assert bs == [7, 7, 7]


def test_tensors_making_different_numbers_of_chunks_are_refused():
    """test_uneven_batch_size's second half: 3 rows and 4 rows in 5 chunks make 3 and 4
    pieces, which cannot pair up: RuntimeError, as before."""
    with pytest.raises(RuntimeError, match="different number of chunks"):
        Pipe(nn.Sequential(Both()), chunks=5)(torch.rand(3, 10), 7, torch.rand(4, 10))


def test_no_chunk_tensors_are_replicated():
    """test_no_chunk: a NoChunk tensor goes whole to each of the 5 micro-batches."""
    a, c = torch.rand(10, 10), torch.rand(10, 10)
    out_a, bs, out_c = run(Pipe(nn.Sequential(Both()), chunks=5), a, 3, NoChunk(c))
    torch.testing.assert_close(out_a, a)
    assert bs == [3] * 5
    torch.testing.assert_close(out_c, torch.cat([c] * 5))


class Listing(nn.Module):
    def forward(self, x):
        return [x, 2 * x]


class TakesList(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


class TakesTwo(nn.Module):
    def forward(self, a, b):
        return a - b


def test_a_list_output_is_one_argument_in_a_stage_and_spread_between_stages():
    """PipeSequential spread only tuples between the layers of a stage; between stages a
    list output was a Batch of values, spread like a tuple."""
    x = torch.rand(4, 2)
    in_one_stage = Pipe(nn.Sequential(nn.Sequential(Listing(), TakesList())), chunks=2)
    torch.testing.assert_close(run(in_one_stage, x), 3 * x)
    across_stages = Pipe(nn.Sequential(Listing(), TakesTwo()), chunks=2)
    torch.testing.assert_close(run(across_stages, x), -x)


# -- 4. argument coercion; the empty model ------------------------------------------------

class MyString:
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return self.value


def test_chunks_and_checkpoint_are_coerced():
    """test_public_attrs: chunks=42.000 became the int 42 and a str-like checkpoint its
    str(); the core Pipe refuses both."""
    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), chunks=42.000, checkpoint=MyString("always"))
    assert pipe.chunks == 42 and isinstance(pipe.chunks, int)
    assert pipe.checkpoint == "always" and isinstance(pipe.checkpoint, str)
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        pipeline_lib.Pipe(nn.Sequential(nn.Linear(1, 1)), chunks=42.0)
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        pipeline_lib.Pipe(nn.Sequential(nn.Linear(1, 1)), checkpoint=MyString("always"))


def test_an_empty_sequential_is_the_identity():
    """test_empty_module: an empty model returns its input; a non-tensor is still
    refused."""
    pipe = Pipe(nn.Sequential(), chunks=4)
    x = torch.tensor(42)
    assert run(pipe, x) is x
    assert len(pipe) == 0 and pipe.devices == []
    with pytest.raises(TypeError):
        pipe(42)
    with pytest.raises(ValueError, match="empty"):
        pipeline_lib.Pipe(nn.Sequential())


# -- stages: cut where the classic Pipe cut -------------------------------------------------

def test_consecutive_layers_on_one_accelerator_share_a_stage():
    """test_merged_partitions, on the meta device standing in for a GPU (any non-CPU
    device counts): consecutive children on one device form one stage, a nested
    Sequential is unpacked into it, and each CPU child is a stage of its own."""
    a = nn.Linear(1, 1, device="meta")
    b = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 2)).to("meta")
    c, d = nn.Linear(1, 1), nn.Linear(1, 2)
    pipe = Pipe(nn.Sequential(a, b, c, d))
    assert [list(stage) for stage in pipe.partitions] == [[a, b[0], b[1]], [c], [d]]
    assert pipe.devices == [torch.device("meta"), torch.device("cpu"), torch.device("cpu")]


def test_with_device_children_are_unwrapped_onto_their_device():
    """test_with_device_wrapper (meta for cuda:1): the wrapped module joins the stage of
    that device, moved there, and iterating the Pipe yields it unwrapped."""
    fc1 = nn.Linear(16, 8, device="meta")
    dropout, relu = nn.Dropout(), nn.ReLU()
    pipe = Pipe(nn.Sequential(fc1, WithDevice(dropout, "meta"), relu))
    assert list(pipe) == [fc1, dropout, relu]
    assert pipe.devices == [torch.device("meta"), torch.device("cpu")]
    fc2 = nn.Linear(8, 4)
    Pipe(nn.Sequential(fc1, WithDevice(fc2, "meta")))
    assert fc2.weight.device.type == "meta"


def test_a_child_with_parameters_on_two_devices_is_refused():
    """_retrieve_device: a child's parameters must all be on one device."""
    class Surrogate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1, device="meta")

    with pytest.raises(ValueError, match="parameters on several devices"):
        Pipe(nn.Sequential(Surrogate()))


# -- 5. balance_by_time: layers taking several arguments ----------------------------------

class Twin(nn.Module):
    def forward(self, x):
        return x, x.detach()


class Add(nn.Module):
    def forward(self, a, b):
        return a + b


def test_balance_by_time_spreads_tuples_into_the_next_layer():
    """test_balance_by_time_tuple: Twin's pair is Add's two arguments; the result is a
    balance the Pipe takes, here cutting two layers into two stages."""
    model = nn.Sequential(Twin(), Add())
    sample = torch.rand(1, requires_grad=True)
    assert balance_by_time(1, model, sample, device="cpu") == [2]
    assert balance_by_time(2, model, sample, timeout=0, device="cpu") == [1, 1]


class Sleep(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x, *rest):
        time.sleep(self.seconds)
        return (x, *rest)


def test_balance_by_time_profiles_until_the_timeout():
    """The classic profiler measured again and again until ``timeout`` had passed."""
    model = nn.Sequential(Sleep(0.01), Sleep(0.0))
    started = time.perf_counter()
    balance_by_time(2, model, [torch.rand(2)], timeout=0.3, device="cpu")
    assert time.perf_counter() - started >= 0.3


# -- 6. skip declarations; DeferredBatchNorm conversion ------------------------------------

def test_a_layer_stashing_and_popping_one_name_is_refused_by_the_checker():
    """test_stash_pop_together_same_name: the decorator accepts the declaration;
    verify_skippables (and so Pipe) refuses it, naming the layer."""
    @skippable(stash=["foo"], pop=["foo"])
    class Layer1(nn.Module):
        pass

    with pytest.raises(TypeError, match="'0' declared 'foo' both as stashable and as "
                                        "poppable"):
        verify_skippables(nn.Sequential(Layer1()))
    with pytest.raises(SkipError, match="both as stashable and as poppable"):
        Pipe(nn.Sequential(Layer1()))
    with pytest.raises(SkipError, match="cannot both stash and pop"):
        pipeline_lib.skippable(stash=["foo"], pop=["foo"])


def test_converting_again_with_other_chunks_makes_a_new_layer():
    """test_convert_deferred_batch_norm: same chunks, the same layer; other chunks, a new
    one (sharing the parameters and running statistics)."""
    dbn = DeferredBatchNorm(3, chunks=4)
    assert DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=4) is dbn
    again = DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=5)
    assert again is not dbn and isinstance(again, DeferredBatchNorm)
    assert again.chunks == 5 and dbn.chunks == 4
    assert again.weight is dbn.weight and again.running_mean is dbn.running_mean
    plain = nn.BatchNorm2d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert_deferred_batch_norm(plain, chunks=4) is plain
    # the core conversion re-chunks in place instead
    assert batchnorm.DeferredBatchNorm.convert(dbn, 5) is dbn and dbn.chunks == 5


def test_a_second_pipe_with_other_chunks_leaves_the_first_pipes_layer():
    """Pipe(deferred_batch_norm=True) converts as convert_deferred_batch_norm did, so a
    model wrapped again with other chunks gets a new layer; the first Pipe keeps its own,
    and both update the one set of running statistics once per mini-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    reference = copy.deepcopy(model)
    first = Pipe(model, chunks=4, deferred_batch_norm=True)
    first_bn = first[1]
    second = Pipe(model, chunks=2, deferred_batch_norm=True)
    assert second[1] is not first_bn and (first_bn.chunks, second[1].chunks) == (4, 2)
    x = torch.randn(8, 3)
    for pipe in (first, second):
        run(pipe, x)
        reference(x)
    assert first_bn.num_batches_tracked.item() == 2
    torch.testing.assert_close(first_bn.running_mean, reference[1].running_mean)
    torch.testing.assert_close(first_bn.running_var, reference[1].running_var)


# -- 7. LocalRRef.backward ----------------------------------------------------------------

def test_the_reference_runs_a_backward_from_a_scalar_as_rref_backward_did():
    """RRef.backward(): autograd from the referenced value, which must be a scalar."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1))
    plain = copy.deepcopy(model)
    x = torch.randn(1, 3)
    Pipe(model, chunks=1)(x).backward()
    plain(x).backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        Pipe(nn.Sequential(nn.Linear(3, 2)), chunks=2)(torch.randn(4, 3)).backward()
