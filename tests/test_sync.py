"""The classic API, `pipeline_lib.sync`: code written for
``torch.distributed.pipeline.sync.Pipe`` runs with only its import changed.

Written from that API's documentation (PyTorch 2.3) and from the tutorial this suite
retells, "Training Transformer models using Pipeline Parallelism"; the last part checks
the classic behaviours that `pipeline_lib.Pipe` itself now has.
"""
import copy
import math
import pickle

import pytest
import torch
from torch import nn

import pipeline_lib
from pipeline_lib import DeferredBatchNorm, is_checkpointing, is_recomputing
from pipeline_lib.sync import LocalRRef, NoChunk, Pipe
from pipeline_lib.sync.skip import Namespace, pop, skippable, stash, verify_skippables
from conftest import assert_same_grads

# -- the tutorial, retold small: the same lines, a model that fits a CPU ------------------

NTOKENS, EMSIZE, NHEAD, NHID, NLAYERS, BPTT = 50, 16, 2, 32, 4, 5


class Encoder(nn.Module):
    """The tutorial's first layer: token ids ``[batch, seq]`` in; the Transformer layers
    after it are sequence-first, so it transposes."""

    def __init__(self, ntoken: int, ninp: int):
        super().__init__()
        self.ninp, self.encoder = ninp, nn.Embedding(ntoken, ninp)

    def forward(self, src):
        return self.encoder(src.t()) * math.sqrt(self.ninp)


class Decoder(nn.Module):
    """The tutorial's last layer: batch-first again, since the pipeline gathers dim 0."""

    def __init__(self, ntoken: int, ninp: int):
        super().__init__()
        self.decoder = nn.Linear(ninp, ntoken)

    def forward(self, inp):
        return self.decoder(inp).permute(1, 0, 2)


def tutorial_module_list(num_stages: int = 2) -> list[nn.Sequential]:
    """The tutorial's ``module_list``: one ``nn.Sequential`` per device (no dropout, so
    the pipelined run can be compared with the plain one)."""
    torch.manual_seed(0)
    partition_len = ((NLAYERS - 1) // num_stages) + 1
    tmp_list, module_list = [Encoder(NTOKENS, EMSIZE)], []
    for i in range(NLAYERS):
        transformer_block = nn.TransformerEncoderLayer(EMSIZE, NHEAD, NHID, dropout=0.0)
        if i != 0 and i % partition_len == 0:
            module_list.append(nn.Sequential(*tmp_list))
            tmp_list = []
        tmp_list.append(transformer_block)
    tmp_list.append(Decoder(NTOKENS, EMSIZE))
    module_list.append(nn.Sequential(*tmp_list))
    return module_list


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-first inputs, as the tutorial's; targets batch-first too (the tutorial
    flattened them sequence-first, its bug #2 in notebook 03)."""
    seq_len = min(BPTT, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len]
    return data.t(), target.t().reshape(-1)


def run_tutorial(chunks: int = 8) -> None:
    """The tutorial's training and evaluation lines on a Pipe, beside the same model
    unpipelined: every loss, gradient and evaluation output must agree."""
    module_list = tutorial_module_list()
    plain = copy.deepcopy(nn.Sequential(*module_list))
    model = Pipe(torch.nn.Sequential(*module_list), chunks=chunks)
    assert len(model.partitions) == 2 and len(model) == NLAYERS + 2

    tokens = torch.randint(NTOKENS, (2000,), generator=torch.Generator().manual_seed(1))
    train_data, val_data = batchify(tokens[:1600], 20), batchify(tokens[1600:], 10)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)

    model.train()
    for batch, i in enumerate(range(0, 3 * BPTT, BPTT)):
        data, targets = get_batch(train_data, i)
        optimizer.zero_grad()
        output = model(data).local_value()
        loss = criterion(output.view(-1, NTOKENS), targets)
        loss.backward()

        plain_optimizer.zero_grad()
        expected = criterion(plain(data).reshape(-1, NTOKENS), targets)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        assert_same_grads(model, plain, rtol=1e-4, atol=1e-6)

        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        plain_optimizer.step()

    model.eval()
    plain.eval()
    with torch.no_grad():
        for i in range(0, 2 * BPTT, BPTT):
            data, targets = get_batch(val_data, i)
            output = model(data).local_value()
            torch.testing.assert_close(output, plain(data), rtol=1e-4, atol=1e-5)


def test_the_tutorials_training_and_evaluation_lines_run_unchanged():
    run_tutorial()


@pytest.mark.skipif(not torch.distributed.rpc.is_available(),
                    reason="this torch build has no torch.distributed.rpc")
def test_the_tutorial_also_runs_with_rpc_initialised_as_it_did(tmp_path):
    from torch.distributed import rpc

    rpc.init_rpc(name="worker", rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"file://{tmp_path / 'rpc-init'}"))
    try:
        run_tutorial()
    finally:
        rpc.shutdown()


# -- forward(*inputs) and its output ----------------------------------------------------

class Pair(nn.Module):
    def forward(self, a, b):
        return a + b, a * b


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, total, product):
        return self.linear(total) - product


@pytest.mark.parametrize("nested", [False, True], ids=["across-stages", "in-one-stage"])
def test_inputs_feed_the_first_layer_and_tuples_spread_into_the_next(nested):
    torch.manual_seed(0)
    mix = Mix()
    a, b = torch.randn(6, 3, requires_grad=True), torch.randn(6, 3)
    expected = mix(*Pair()(a, b))
    layers = (Pair(), mix)
    model = nn.Sequential(nn.Sequential(*layers)) if nested else nn.Sequential(*layers)

    out = Pipe(model, chunks=3)(a, b).local_value()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), a)[0],
                               torch.autograd.grad(expected.sum(), a)[0])


def test_the_output_is_an_rref_like_reference_to_the_local_value():
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)
    x = torch.randn(4, 2)
    rref = pipe(x)
    assert isinstance(rref, LocalRRef) and rref.is_owner()
    assert rref.to_here() is rref.local_value()
    torch.testing.assert_close(rref.local_value(), pipe[0](x))


class Rows(nn.Module):
    """Records the rows of every micro-batch it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(len(x))
        return x


@pytest.mark.parametrize("rows,chunks,micro_rows", [
    (2, 4, [1, 1]), (3, 4, [1, 1, 1]), (10, 4, [3, 3, 3, 1]), (6, 4, [2, 2, 2]),
    (20, 8, [3, 3, 3, 3, 3, 3, 2])])          # the last: the classic tutorial's sizes
def test_micro_batches_have_torch_chunk_sizes(rows, chunks, micro_rows):
    """The classic microbatch.scatter: ``tensor.chunk(chunks)``, which makes pieces of
    ceil(rows / chunks) rows and may make fewer than ``chunks`` (the classic tests
    test_batch_size_small and test_batch_size_indivisible ran such batches)."""
    counter = Rows()
    pipe = Pipe(nn.Sequential(counter, nn.Linear(2, 2)), chunks=chunks)
    x = torch.randn(rows, 2)
    torch.testing.assert_close(pipe(x).local_value(), pipe[1](x))
    assert counter.seen == micro_rows and pipe.chunks == chunks


def test_deferred_batch_norm_commits_once_for_a_batch_smaller_than_chunks():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    reference = copy.deepcopy(bn)
    pipe = Pipe(nn.Sequential(bn), chunks=4, deferred_batch_norm=True)
    x = torch.randn(3, 3, 4)                     # 3 micro-batches of one row
    pipe(x)
    reference(x)
    deferred = pipe[0]
    assert isinstance(deferred, DeferredBatchNorm) and deferred.chunks == 4
    assert deferred.num_batches_tracked.item() == 1
    torch.testing.assert_close(deferred.running_mean, reference.running_mean)
    torch.testing.assert_close(deferred.running_var, reference.running_var)


# -- checkpointing in eval mode: never (the classic Pipe and pipeline_lib.Pipe) -----------

class Spy(nn.Linear):
    """Counts its forwards and notes whether any ran for a checkpoint."""

    def __init__(self):
        super().__init__(2, 2)
        self.calls, self.checkpointed = 0, False

    def forward(self, x):
        self.calls += 1
        self.checkpointed |= is_checkpointing() or is_recomputing()
        return super().forward(x)


def classic(module):
    return lambda x: Pipe(module, chunks=2, checkpoint="always")(x).local_value()


def library(module):
    return pipeline_lib.Pipe(module, chunks=2, checkpoint="always")


@pytest.mark.parametrize("wrap", [classic, library], ids=["sync.Pipe", "pipeline_lib.Pipe"])
def test_eval_mode_never_checkpoints(wrap):
    spy = Spy()
    model = nn.Sequential(spy, nn.Linear(2, 2))
    run = wrap(model)
    x = torch.randn(4, 2)

    model.train()                                # the control: checkpoint, then recompute
    run(x).sum().backward()
    assert spy.calls == 4 and spy.checkpointed

    spy.calls, spy.checkpointed = 0, False
    model.eval()                                 # grad still enabled: one forward each
    run(x).sum().backward()
    assert spy.calls == 2 and not spy.checkpointed


# -- non-tensors and NoChunk ------------------------------------------------------------

class Probe(nn.Module):
    """Records what each micro-batch brings; hands on a tensor and two non-tensors."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, mask, flag):
        self.seen.append((len(x), tuple(mask.shape), flag))
        return x * mask, flag, len(x)


class Pass(nn.Module):
    def forward(self, *values):
        return values


def test_non_tensors_and_no_chunk_go_whole_to_every_micro_batch():
    probe = Probe()
    x, mask = torch.randn(5, 4), torch.randn(4)  # 4 rows in the mask, 5 in the batch
    pipe = Pipe(nn.Sequential(probe, Pass()), chunks=3)
    out, flags, rows = pipe(x, NoChunk(mask), "flag").local_value()

    assert probe.seen == [(2, (4,), "flag"), (2, (4,), "flag"), (1, (4,), "flag")]
    torch.testing.assert_close(out, x * mask)
    # a non-tensor of the last stage's output: the list of every micro-batch's value
    assert flags == ["flag"] * 3 and rows == [2, 2, 1]


class Returns(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value


@pytest.mark.parametrize("value", [5, None, ("a", 3), []])
def test_a_stage_output_without_a_tensor_is_refused(value):
    pipe = Pipe(nn.Sequential(Returns(value), nn.Identity()), chunks=2)
    with pytest.raises(TypeError, match="with no tensor"):
        pipe(torch.randn(4, 2))


@pytest.mark.parametrize("inputs", [(5,), ("a", None), (NoChunk(torch.ones(2)),)])
def test_inputs_without_a_tensor_to_split_are_refused(inputs):
    with pytest.raises(TypeError):
        Pipe(nn.Sequential(Pass()), chunks=2)(*inputs)


def test_inputs_must_be_on_the_first_stages_device():
    with pytest.raises(ValueError, match="first stage's device cpu"):
        Pipe(nn.Sequential(nn.Identity()), chunks=2)(torch.empty(4, 2, device="meta"))


# -- the classic Pipe does not move; it reads like an nn.Sequential ----------------------

@pytest.mark.parametrize("move", [
    lambda p: p.cuda(), lambda p: p.cpu(), lambda p: p.to("cpu"), lambda p: p.to(0),
    lambda p: p.to(torch.device("cpu")), lambda p: p.to(device="cpu"),
    lambda p: p.to(torch.zeros(1)), lambda p: p.to(tensor=torch.zeros(1)),
], ids=["cuda", "cpu", "to-str", "to-int", "to-device", "to-device=", "to-tensor",
        "to-tensor="])
def test_moving_the_classic_pipe_is_refused(move):
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="cannot be moved"):
        move(pipe)


def test_a_dtype_conversion_is_allowed():
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)
    assert pipe.to(torch.float64) is pipe and pipe[0].weight.dtype == torch.float64
    assert pipe(torch.randn(4, 2, dtype=torch.float64)).local_value().dtype == torch.float64


def test_len_indexing_and_iteration_go_over_the_layers():
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()]
    pipe = Pipe(nn.Sequential(layers[0], nn.Sequential(*layers[1:3]), layers[3]))
    assert len(pipe.partitions) == 3 and len(pipe) == 4
    assert list(pipe) == layers
    assert [pipe[i] for i in (0, 2, -1, -4)] == [layers[0], layers[2], layers[3], layers[0]]
    for index in (4, -5):
        with pytest.raises(IndexError):
            pipe[index]


def test_misuse_raises_the_classic_exception_types():
    with pytest.raises(TypeError):
        Pipe(nn.Linear(2, 2))
    with pytest.raises(ValueError):
        Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=0)
    with pytest.raises(ValueError):
        Pipe(nn.Sequential(nn.Linear(2, 2)), checkpoint="sometimes")


def test_a_layer_listed_twice_is_refused():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layers 0 and 1 of the nn.Sequential are the same"):
        Pipe(nn.Sequential(lin, lin))


# -- skip connections under their classic names -----------------------------------------

@skippable(stash=["skip"])
class Save(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x


@skippable(stash=["skip"])
class SaveNothing(nn.Module):
    def forward(self, x):
        yield stash("skip", None)
        return x


@skippable(pop=["skip"])
class AddBack(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x if skip is None else x + skip


def classic_forward(model):
    return lambda x: Pipe(model, chunks=2)(x).local_value()


@pytest.mark.parametrize("wrap", [lambda model: model, classic_forward,
                                  lambda model: pipeline_lib.Pipe(model, chunks=2)],
                         ids=["plain", "sync.Pipe", "pipeline_lib.Pipe"])
@pytest.mark.parametrize("saver,added", [(Save, True), (SaveNothing, False)],
                         ids=["stash-tensor", "stash-None"])
def test_skips_reach_the_pop_across_stages(wrap, saver, added):
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)
    x = torch.randn(4, 3)
    expected = linear(x) + x if added else linear(x)
    out = wrap(nn.Sequential(saver(), linear, AddBack()))(x)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stash_none_in_a_scheduled_step(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(SaveNothing(), nn.Linear(3, 3), AddBack())
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    nn.MSELoss()(reference(x), y).backward()
    loss = pipeline_lib.Pipe(model, chunks=2).step(x, y, nn.MSELoss(), schedule)
    torch.testing.assert_close(loss, nn.MSELoss()(reference(x), y).detach())
    torch.testing.assert_close(model[1].weight.grad, reference[1].weight.grad)


def test_a_copied_namespace_still_matches_its_original():
    ns = Namespace()
    for twin in (copy.copy(ns), copy.deepcopy(ns), pickle.loads(pickle.dumps(ns))):
        assert twin == ns and hash(twin) == hash(ns)
    assert Namespace() != ns
    # so a deep-copied layer still pairs with its original partner
    verify_skippables(nn.Sequential(copy.deepcopy(Save().isolate(ns)), nn.Identity(),
                                    AddBack().isolate(ns)))


@skippable(stash=["declared"])
class StashesUndeclared(nn.Module):
    def forward(self, x):
        yield stash("other", x)
        return x


@skippable(stash=["skip"])
class ForgetsToStash(nn.Module):
    def forward(self, x):
        return x


@skippable(pop=["skip"])
class ForgetsToPop(nn.Module):
    def forward(self, x):
        yield from ()
        return x


@skippable(pop=["nowhere"])
class PopsUnstashed(nn.Module):
    def forward(self, x):
        return x + (yield pop("nowhere"))


@skippable(stash=["skip"])
class YieldsNonsense(nn.Module):
    def forward(self, x):
        yield "stash please"
        return x


def test_skip_misuse_raises_the_classic_types():
    x = torch.zeros(2, 3)
    # stashes and pops that do not pair up: TypeError
    with pytest.raises(TypeError, match="never popped"):
        verify_skippables(nn.Sequential(Save()))
    with pytest.raises(TypeError, match="never stashed"):
        Pipe(nn.Sequential(nn.Identity(), AddBack()))
    # a bad stash or pop during the forward: RuntimeError
    with pytest.raises(RuntimeError, match=r"yielded stash\('other', <tensor>\)"):
        StashesUndeclared()(x)
    with pytest.raises(RuntimeError, match=r"did not stash \['skip'\]"):
        ForgetsToStash()(x)
    ns = Namespace()    # the stash this leaves on the thread must not reach other tests
    with pytest.raises(RuntimeError, match=r"did not pop \['skip'\]"):
        nn.Sequential(Save().isolate(ns), ForgetsToPop().isolate(ns))(x)
    with pytest.raises(RuntimeError, match="found no stashed tensor"):
        PopsUnstashed()(x)
    # something that is no stash or pop command: TypeError
    with pytest.raises(TypeError, match="yielded 'stash please'"):
        YieldsNonsense()(x)


# -- pipeline_lib.Pipe itself -----------------------------------------------------------

def test_wrapping_again_with_other_chunks_rechunks_deferred_batch_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    reference = copy.deepcopy(model)
    pipeline_lib.Pipe(model, chunks=4, deferred_batch_norm=True)
    pipe = pipeline_lib.Pipe(model, chunks=2, deferred_batch_norm=True)
    assert isinstance(model[1], DeferredBatchNorm) and model[1].chunks == 2

    x = torch.randn(8, 3)
    pipe(x)                                      # two micro-batches: one commit
    reference(x)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)


def test_pipe_refuses_a_move_and_its_devices_stay_true():
    pipe = pipeline_lib.Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2)
    with pytest.raises(TypeError, match="cannot move a Pipe from cpu to meta"):
        pipe.to("meta")
    assert pipe.devices == [torch.device("cpu")] * 2
    assert all(p.device.type == "cpu" for p in pipe.parameters())
    # what moves nothing is fine: a no-op .cpu(), a dtype conversion
    assert pipe.cpu().double() is pipe
    assert pipe(torch.randn(4, 2, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to move to")
def test_pipe_refuses_cuda():
    pipe = pipeline_lib.Pipe(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="cannot move a Pipe from cpu to cuda"):
        pipe.cuda()
    assert pipe.devices == [torch.device("cpu")]
