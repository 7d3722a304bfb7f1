"""The Transformer LM's block laid out so that tensor parallelism can split it by heads.

`lm.model.CausalBlock` is an ``nn.TransformerEncoderLayer``, whose attention keeps the
query, key and value projections in one packed ``[3·d, d]`` parameter,
``in_proj_weight``: rows 0 to d are every head's queries, then every head's keys, then
values. Splitting its rows over t ranks would give rank 0 all the queries and no keys,
and a tensor-parallel plan (`ColwiseParallel`) shards whole ``nn.Linear`` modules, not
one parameter in thirds. `ShardableBlock` computes the same function with the three
projections as separate ``nn.Linear``\\ s (as torchtitan's Llama and Megatron-LM's
per-head interleaved QKV allow), so that splitting each by rows gives every rank whole
heads: ``d / t`` rows of each is ``heads / t`` heads.

Nothing else changes: the same parameters (the three ``[d, d]`` projections are the
thirds of ``in_proj_weight``), the same operations in the same order, the same dropout
masks drawn in the same order (on one rank), and the same state-dict names:
``state_dict()`` joins the three projections back into ``layer.self_attn.in_proj_weight``
and ``in_proj_bias``, and ``load_state_dict`` splits them, so checkpoints, `run_state`
and the notebooks see the names of ``transformer_lm(...).state_dict()``.

Split over t ranks (`tensor_parallel`, PyTorch's plans; `by_hand`, written out), each rank
runs its share of the heads and of the MLP's hidden units; the attributes
``tp_rank``, ``tp`` and ``sequence_parallel`` tell the block which of its dropouts act on
a tensor that is split over the ranks (`streams.sharded_stream`).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pipeline_lib.lm.model import CausalBlock
from pipeline_lib.parallel.streams import sharded_stream

_QKV = ("q_proj", "k_proj", "v_proj")
T = TypeVar("T")


def _whole(t: Tensor) -> Tensor:
    """A tensor as one process would hold it: a sharded `DTensor` gathered (a collective:
    every rank of its mesh must call ``state_dict()`` together)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


class SelfAttention(nn.Module):
    """Causal multi-head self-attention as ``nn.MultiheadAttention(batch_first=True)``
    computes it, with separate query, key and value projections. A rank holding
    ``heads / t`` heads sees ``d / t`` output columns from each projection: the number
    of heads it runs is read from its tensors, never stored."""

    def __init__(self, d_model: int, nhead: int, dropout: float) -> None:
        super().__init__()
        self.head_dim, self.dropout = d_model // nhead, dropout
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in _QKV)
        self.out_proj = nn.Linear(d_model, d_model)
        self.register_state_dict_post_hook(_packed)
        self.register_load_state_dict_pre_hook(_unpacked)
        self.tp_rank, self.tp = 0, 1

    def forward(self, x: Tensor) -> Tensor:
        batch, length = x.shape[:2]

        def heads(projection: nn.Linear) -> Tensor:   # [B, T, h·hd] -> [B, h, T, hd]
            return projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        p = self.dropout if self.training else 0.0
        ranks = self.tp if p > 0 else 1     # this rank's heads: its own masks
        with sharded_stream(self.tp_rank, ranks, x.device):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        # as nn.MultiheadAttention: the output projected in [T, B, d] memory order, then
        # viewed batch first (a dropout after it draws its mask in that order too); a
        # sequence split over the ranks (Shard(0) of these rows) gives `length` / t rows
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(length * batch, -1))
        return out.view(-1, batch, out.size(-1)).transpose(0, 1)


def _packed(module: SelfAttention, state: dict[str, Any], prefix: str, _: Any) -> None:
    """state_dict: q_proj, k_proj, v_proj -> ``nn.MultiheadAttention``'s packed names,
    in its order (the packed ones first). This module's entries are the last ones yet."""
    mine = {key: state.pop(key) for key in [k for k in state if k.startswith(prefix)]}
    state.update(pack_projections({k: _whole(v) if k in _in_projection(prefix) else v
                                   for k, v in mine.items()}, torch.cat))


def _unpacked(module: SelfAttention, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict: the packed names -> q_proj, k_proj, v_proj (where present)."""
    packed = {k: state.pop(k) for k in [f"{prefix}in_proj_{kind}" for kind in ("weight", "bias")]
              if k in state}
    state.update(unpack_projections(packed, lambda t: list(t.chunk(3))))


def _in_projection(prefix: str) -> set[str]:
    return {f"{prefix}{name}.{kind}" for name in _QKV for kind in ("weight", "bias")}


def packed_name(name: str) -> str:
    """A parameter's name in a state dict: a `SelfAttention`'s ``...self_attn.q_proj.weight``
    (or k_proj, v_proj; or bias) is ``...self_attn.in_proj_weight``, as
    ``nn.MultiheadAttention`` names it; any other name is itself."""
    head, _, kind = name.rpartition(".")
    prefix, _, projection = head.rpartition(".")
    if projection in _QKV and kind in ("weight", "bias") and (
            prefix.endswith("self_attn") or not prefix):   # (a SelfAttention's own state)
        return f"{prefix}.in_proj_{kind}" if prefix else f"in_proj_{kind}"
    return name


def pack_projections(values: dict[str, T], join: Callable[[list[T]], T]) -> dict[str, T]:
    """``values`` by parameter name, with each attention's query, key and value entries
    joined (``join([q, k, v])``) under `packed_name`, where the query's entry was."""
    out: dict[str, T] = {}
    for name, value in values.items():
        packed = packed_name(name)
        if packed == name:
            out[name] = value
        elif packed not in out:
            head, _, kind = name.rpartition(".")
            stem = head.rpartition(".")[0]
            prefix = f"{stem}." if stem else ""
            out[packed] = join([values[f"{prefix}{p}.{kind}"] for p in _QKV])
    return out


def unpack_projections(values: dict[str, T], split: Callable[[T], list[T]]) -> dict[str, T]:
    """The inverse of `pack_projections`: each packed entry split (``split(value)`` gives
    the query's, key's and value's) under the three projections' names."""
    out: dict[str, T] = {}
    for name, value in values.items():
        stem, _, last = name.rpartition(".")
        if last in ("in_proj_weight", "in_proj_bias"):
            kind = last.removeprefix("in_proj_")
            prefix = f"{stem}." if stem else ""
            out.update({f"{prefix}{p}.{kind}": part for p, part in zip(_QKV, split(value))})
        else:
            out[name] = value
    return out


class _Layer(nn.Module):
    """Holds the block's modules under ``nn.TransformerEncoderLayer``'s names."""

    def __init__(self, d_model: int, nhead: int, d_hid: int, dropout: float, eps: float):
        super().__init__()
        self.self_attn = SelfAttention(d_model, nhead, dropout)
        self.linear1, self.linear2 = nn.Linear(d_model, d_hid), nn.Linear(d_hid, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model, eps), nn.LayerNorm(d_model, eps)
        self.dropout, self.dropout1, self.dropout2 = (nn.Dropout(dropout) for _ in range(3))


class ShardableBlock(nn.Module):
    """`CausalBlock`'s function (post-norm, ReLU MLP, dropout after the attention
    probabilities, inside the MLP and on both branches), laid out for tensor parallelism."""

    def __init__(self, d_model: int, nhead: int, d_hid: int, dropout: float,
                 eps: float = 1e-5) -> None:
        super().__init__()
        self.layer = _Layer(d_model, nhead, d_hid, dropout, eps)
        self.sequence_parallel = False

    def forward(self, x: Tensor) -> Tensor:
        layer = self.layer
        # the branches' outputs are split over the ranks only under sequence parallelism
        attended = self._dropped(layer.dropout1, layer.self_attn(x), self.sequence_parallel)
        x = layer.norm1(x + attended)
        hidden = self._dropped(layer.dropout, F.relu(layer.linear1(x)), True)  # its units
        out = self._dropped(layer.dropout2, layer.linear2(hidden), self.sequence_parallel)
        return layer.norm2(x + out)

    def _dropped(self, dropout: nn.Dropout, x: Tensor, split: bool) -> Tensor:
        """``dropout(x)``, on this rank's own stream if ``x`` is split over the ranks."""
        attention = self.layer.self_attn
        if not (split and self.training and dropout.p > 0):
            return dropout(x)
        with sharded_stream(attention.tp_rank, attention.tp, x.device):
            return dropout(x)

    @classmethod
    def from_causal(cls, block: CausalBlock) -> "ShardableBlock":
        """The same block, same weights (copied), laid out for splitting."""
        encoder = block.layer
        attention = encoder.self_attn
        if encoder.norm_first or encoder.activation_relu_or_gelu != 1 \
                or not attention.batch_first or attention._qkv_same_embed_dim is False:
            raise ValueError("ShardableBlock reproduces CausalBlock's layer: post-norm, "
                             "ReLU, batch-first attention with one packed projection")
        d_model, d_hid = attention.embed_dim, encoder.linear1.out_features
        shardable = cls(d_model, attention.num_heads, d_hid, encoder.dropout.p,
                        encoder.norm1.eps).to(attention.in_proj_weight)
        shardable.load_state_dict(block.state_dict())
        shardable.train(block.training)
        return shardable


def check_splits(block: ShardableBlock, ranks: int) -> None:
    """Refuse a split over ``ranks`` that would not give every rank whole heads and an
    equal share of the MLP's hidden units."""
    attention = block.layer.self_attn
    heads = attention.q_proj.out_features // attention.head_dim
    hidden = block.layer.linear1.out_features
    if heads % ranks or hidden % ranks:
        raise ValueError(f"a block of {heads} heads and {hidden} hidden units cannot be "
                         f"split over {ranks} tensor-parallel ranks: each rank computes "
                         f"whole heads, heads / tp of them, and hidden / tp units; choose a "
                         f"tp that divides both")


def shardable(model: nn.Sequential) -> nn.Sequential:
    """A copy of ``model`` (a ``transformer_lm``) with every `CausalBlock` laid out as a
    `ShardableBlock`: the same function, parameters and state-dict names."""
    return nn.Sequential(*(ShardableBlock.from_causal(layer) if isinstance(layer, CausalBlock)
                           else copy.deepcopy(layer) for layer in model))
