"""The pieces of the 3-D mesh that one process can check: the block laid out for tensor
parallelism computes what `CausalBlock` computes (outputs, dropout masks, gradients,
state-dict names), the rank orders, the dropout streams, and how `Traffic` prices a
message. `test_parallel_dist.py` runs the distributed parts on gloo processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline_lib.lm.model import CausalBlock, transformer_lm
from pipeline_lib.parallel import rank_order
from pipeline_lib.parallel.block import ShardableBlock, check_splits, shardable
from pipeline_lib.parallel.streams import sharded_stream
from pipeline_lib.parallel.traffic import Message
from pipeline_lib.rng import microbatch_rng, owned_rng, seed_for, shared_rng
from pipeline_lib.stage import StageRunner


def lm(dropout: float) -> nn.Sequential:
    torch.manual_seed(0)
    return transformer_lm(50, d_model=16, nhead=4, d_hid=32, nlayers=2, dropout=dropout)


def packed_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by ``transformer_lm``'s names (q, k, v joined into in_proj)."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in [n for n in grads if ".q_proj." in n]:
        prefix, kind = name.split(".q_proj.")
        grads[f"{prefix}.in_proj_{kind}"] = torch.cat(
            [grads.pop(f"{prefix}.{p}_proj.{kind}") for p in "qkv"])
    return grads


@pytest.mark.parametrize("stream", [owned_rng, microbatch_rng], ids=["owned", "threads"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_shardable_block_computes_what_causal_block_computes(stream, training):
    """Same outputs bit for bit (dropout masks included: drawn in the same order, in the
    same memory order), same gradients, same state-dict names and values."""
    model = lm(dropout=0.3)
    split = shardable(model)
    assert all(isinstance(layer, ShardableBlock) for layer in split[1:-1])
    assert list(split.state_dict()) == list(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(split.state_dict().values(),
                                                  model.state_dict().values()))
    model.train(training), split.train(training)
    ids = torch.randint(0, 50, (3, 9))
    with stream(7):
        want = model(ids)
    with stream(7):
        got = split(ids)
    assert torch.equal(got, want)
    if training:
        want.square().mean().backward()
        got.square().mean().backward()
        expected = dict(model.named_parameters())
        for name, grad in packed_grads(split).items():
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-5, atol=1e-7,
                                       msg=name)


def test_state_dict_round_trip_and_copy():
    """A checkpoint of either layout loads into the other; `shardable` copies, leaving
    the caller's model as it was."""
    model, other = lm(0.0), transformer_lm(50, d_model=16, nhead=4, d_hid=32, nlayers=2)
    split = shardable(model)
    with torch.no_grad():
        for p in split.parameters():
            p.add_(1.0)
    other.load_state_dict(split.state_dict())
    back = shardable(transformer_lm(50, d_model=16, nhead=4, d_hid=32, nlayers=2))
    back.load_state_dict(other.state_dict())
    for a, b in zip(back.state_dict().values(), split.state_dict().values()):
        assert torch.equal(a, b)
    assert not torch.equal(model.state_dict()["0.tokens.weight"],
                           split.state_dict()["0.tokens.weight"])


@pytest.mark.parametrize("ranks", [3, 8])
def test_a_split_must_give_whole_heads(ranks):
    block = ShardableBlock(16, 4, 32, 0.0)
    with pytest.raises(ValueError, match="whole heads"):
        check_splits(block, ranks)
    check_splits(block, 2)


def test_from_causal_refuses_other_layouts():
    block = CausalBlock(16, 4, 32, 0.0)
    block.layer.norm_first = True
    with pytest.raises(ValueError, match="post-norm"):
        ShardableBlock.from_causal(block)


def test_sharded_streams_differ_by_rank_and_leave_the_shared_stream_alone():
    """Two ranks' masks in a sharded region differ; the shared stream after it is the
    same on both, and as it would be with one rank drawing one number; all replay."""
    def run(rank: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        with owned_rng(11):
            with sharded_stream(rank, ranks):
                inside = torch.rand(64)
            return inside, torch.rand(64)

    (a0, after0), (a1, after1) = run(0, 2), run(1, 2)
    assert not torch.equal(a0, a1)
    assert torch.equal(after0, after1)
    assert torch.equal(run(0, 2)[0], a0)                 # replays
    one, after = run(0, 1)                               # one rank: nothing forked
    with owned_rng(11):
        assert torch.equal(one, torch.rand(64))
    assert not torch.equal(after, after0)                # a fork draws one number


@pytest.mark.parametrize("stream", [owned_rng, microbatch_rng, shared_rng],
                         ids=["owned", "every kernel", "drawing layers"])
def test_sharded_streams_replay_under_recompute(stream):
    """A block whose dropouts draw from a sharded stream (as rank 1 of 2 would, sequence
    parallelism included) gets the same gradients when its forward is recomputed for the
    backward (activation checkpointing) as when it is kept: the region's seed comes
    from the stage's stream, which the recompute replays."""
    torch.manual_seed(0)
    block = ShardableBlock(16, 4, 32, dropout=0.5)
    block.layer.self_attn.tp_rank, block.layer.self_attn.tp = 1, 2
    block.sequence_parallel = True
    x = torch.randn(2, 6, 16)
    grads = {}
    for mode in ("never", "always"):
        block.zero_grad()
        runner = StageRunner(1, nn.Sequential(block), torch.device("cpu"), mode, 1, 5,
                             loss_fn=lambda out, _: out.square().mean(), loss_weights=[1.0],
                             rng=stream)
        runner.forward(0, x, None)
        runner.backward(0)
        grads[mode] = [p.grad.clone() for p in block.parameters()]
    for a, b in zip(grads["never"], grads["always"]):
        assert torch.equal(a, b)
    with owned_rng(seed_for(5, 1, 0)):   # the stage's stream: the sharded one changed the masks
        block.layer.self_attn.tp = 1
        block.sequence_parallel = False
        block.zero_grad()
        block(x).square().mean().backward()
    assert not torch.equal(next(block.parameters()).grad, grads["never"][0])


MEGATRON_GROUPS = {   # Megatron-LM's docstring example shape, t = 2, p = 2, d = 2
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}


def test_rank_orders():
    sizes = {"tp": 2, "pp": 2, "dp": 2}
    for dim, want in MEGATRON_GROUPS.items():
        assert rank_order.groups(dim, rank_order.MEGATRON, sizes) == want
    assert rank_order.groups("pp", rank_order.LLAMA3, sizes) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_order.groups("dp", rank_order.LLAMA3, sizes) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    uneven = {"tp": 2, "pp": 3, "dp": 4}
    for order in ("tp-dp-pp", "tp-pp-dp", "pp-dp-tp", "dp-tp-pp"):
        for rank in range(24):
            coords = rank_order.coordinates(rank, order, uneven)
            assert rank_order.global_rank(coords, order, uneven) == rank
        for dim in uneven:
            found = rank_order.groups(dim, order, uneven)
            assert sorted(r for g in found for r in g) == list(range(24))
            assert all(len(g) == uneven[dim] for g in found)
    # the executor's 2-D orders, written as orders
    assert rank_order.groups("pp", "pp-dp", {"pp": 4, "dp": 2}) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_order.groups("dp", "dp-pp", {"pp": 4, "dp": 2}) == [[0, 1], [2, 3], [4, 5],
                                                                    [6, 7]]


@pytest.mark.parametrize("order, sizes, says", [
    ("tp-dp-xx", {"tp": 2, "dp": 2}, "each of"),
    ("tp-tp", {"tp": 2}, "each of"),
    ("tp-dp", {"tp": 2, "pp": 2}, "name the same"),
    ("tp-dp", {"tp": 0, "dp": 2}, "positive"),
])
def test_rank_order_refuses(order, sizes, says):
    with pytest.raises(ValueError, match=says):
        rank_order.groups("tp", order, sizes)


@pytest.mark.parametrize("kind, ranks, root, share", [
    ("all_reduce", 4, True, 1.5), ("all_gather", 4, True, 0.75),
    ("reduce_scatter", 2, True, 0.5), ("send", 2, True, 1.0), ("receive", 2, True, 0.0),
    ("broadcast", 4, True, 1.0), ("broadcast", 4, False, 0.0)])
def test_message_bytes_as_a_ring_sends_them(kind, ranks, root, share):
    assert Message("tp", kind, 1000, ranks, root).sent == share * 1000
