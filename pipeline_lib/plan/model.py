"""What is trained and how it is laid out: `Model` (a decoder-only Transformer) and
`Layout` (tensor × pipeline × data parallelism, micro-batch, schedule, recompute)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline_lib.schedules import BUILDERS, LOOPED, V_SHAPED

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Work:
    """What one pass dispatches in an eager framework: its operations, the FLOPs of its
    matrix multiplies, the bytes those read and write (``gemm_bytes``: weights
    streamed, inputs, outputs) and the bytes every other operation reads and writes
    (``nbytes``; views and allocations move none). `Cluster.work_seconds` prices it."""

    ops: int
    flops: float = 0.0
    gemm_bytes: float = 0.0
    nbytes: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.ops, bool) or not isinstance(self.ops, int) or self.ops < 0 \
                or min(self.flops, self.gemm_bytes, self.nbytes) < 0:
            raise ValueError(f"Work: ops must be an integer >= 0 and flops, gemm_bytes, "
                             f"nbytes >= 0; got {self!r}")


Passes = tuple[Work, Work]   # (forward, backward)


@dataclass(frozen=True)
class Kernels:
    """The kernels an eager framework dispatches for one micro-batch of ``tokens``
    tokens, forward and backward: of one block, of the embedding, and of the head (final
    norm, vocabulary projection and loss). Counted once on the real modules with a
    dispatch mode (`pipeline_lib.plan.kernels.count_kernels`): on a CPU a small model's
    step is mostly what each operation costs however small, and its kernels are not the
    fused ones a GPU framework queues ahead, so they are priced as counted. Without them
    a `Model` is priced from its FLOP and byte formulas (`costs`)."""

    block: Passes
    embedding: Passes
    head: Passes
    tokens: int

    def __post_init__(self) -> None:
        for name in ("block", "embedding", "head"):
            value = getattr(self, name)
            if len(value) != 2 or not all(isinstance(w, Work) for w in value):
                raise ValueError(f"Kernels: {name} must be (forward, backward) `Work`s; "
                                 f"got {value!r}")


@dataclass(frozen=True)
class Model:
    """A GPT-style decoder: ``layers`` blocks of attention + MLP, a vocabulary projection.

    ``kv_heads`` < ``heads`` is grouped-query attention; ``gated_mlp`` a SwiGLU MLP (three
    matrices of ``hidden × ffn_hidden``; Llama) instead of two (GPT). ``dropout``: whether
    the blocks drop out (GPT-2/3 and Megatron-LM's GPTs do, after the attention softmax
    and before each residual add; Llama does not), which decides whether the backward
    keeps dropout masks (Korthikanti et al. 2022, Sec. 4.1). ``kernels``: what its
    implementation dispatches per pass, counted (`Kernels`), for an eager CPU run; None
    prices the kernels of its FLOP and byte formulas."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    gated_mlp: bool = False
    dropout: bool = True
    kernels: Kernels | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "ffn_hidden", "kv_heads"):
            value = getattr(self, name)
            if value is None and name in ("ffn_hidden", "kv_heads"):
                continue    # the default: 4 · hidden, or one key-value head per head
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Model: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"Model: hidden {self.hidden} is not a multiple of heads "
                             f"{self.heads}; each head gets hidden / heads channels")
        if self.heads % self.kv:
            raise ValueError(f"Model: heads {self.heads} is not a multiple of kv_heads "
                             f"{self.kv}; grouped-query attention shares each key-value "
                             f"head among heads / kv_heads query heads")

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def qkv_width(self) -> int:
        """Output width of the fused query-key-value projection."""
        return self.hidden + 2 * self.kv * (self.hidden // self.heads)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def layer_parameters(self) -> int:
        """Weights and biases of one block (2 layer norms of 2·hidden each)."""
        h, f = self.hidden, self.ffn
        up = f * (self.mlp_matrices - 1)
        return (h * self.qkv_width + self.qkv_width + h * h + h
                + h * up + up + f * h + h + 4 * h)

    def parameters(self) -> int:
        """All parameters: the blocks and one vocabulary embedding (tied with the output)."""
        return self.layers * self.layer_parameters() + self.vocab * self.hidden

    def flops_per_token(self, recompute: bool = False) -> float:
        """Matrix-multiply FLOPs per token of one training step: forward, input gradient
        and weight gradient of every layer and of the vocabulary projection (Narayanan
        et al. 2021, Eq. 3, generalised to grouped-query and gated MLPs: for a GPT,
        72·s·l·h²·(1 + s/(6h) + V/(12·l·h)) per sequence, 96 with ``recompute``)."""
        h, s = self.hidden, self.seq_len
        linear = 2 * (h * self.qkv_width + h * h + self.mlp_matrices * h * self.ffn)
        attention = 4 * s * h
        forward = self.layers * (linear + attention)
        return (4 if recompute else 3) * forward + 6 * h * self.vocab


@dataclass(frozen=True)
class Layout:
    """How ``tp × pp × dp`` GPUs train a model.

    ``schedule`` names a builder of `pipeline_lib.schedules` (gpipe, 1f1b, zb_h1, zb_h2,
    interleaved_1f1b, interleaved_zero_bubble, looped_bfs, zb_v, dualpipe_v). Looped
    schedules put ``virtual_stages`` chunks on each pipeline rank, V-shaped ones 2.
    ``recompute``: "none", "selective" (the attention core, Korthikanti et al. 2022) or
    "full" (each layer's forward again before its backward). ``flash_attention``: the
    attention core fused into one kernel that never writes the s × s scores (Dao et al.
    2022; Megatron-LM's 2021 runs predate it, Llama 3 uses it).
    ``distributed_optimizer`` shards the optimizer states over the ``dp`` replicas
    (ZeRO stage 1, Megatron-LM's distributed optimizer); ``shard_gradients`` the
    gradients as well (ZeRO stage 2; Llama 3's FSDP, Dubey et al. 2024, Sec. 3.3.1): each
    replica keeps only the reduce-scattered slice it updates, so it needs the first. Its
    time is priced as the distributed optimizer's, one reduce-scatter per step; a run that
    reduce-scatters after every micro-batch instead pays m of them, which is not priced.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    flash_attention: bool = False
    shard_gradients: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout: {name} must be a positive integer, got {value!r}")
        if self.schedule not in BUILDERS:
            raise ValueError(f"Layout: unknown schedule {self.schedule!r}; choose one of "
                             f"{sorted(BUILDERS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout: recompute must be one of {RECOMPUTE}, "
                             f"got {self.recompute!r}")
        if self.schedule in V_SHAPED and self.virtual_stages not in (1, 2):
            raise ValueError(f"Layout: {self.schedule} always puts 2 stages on each rank; "
                             f"leave virtual_stages at 1 (or 2), not {self.virtual_stages}")
        if self.schedule not in LOOPED + V_SHAPED and self.virtual_stages != 1:
            raise ValueError(f"Layout: {self.schedule} runs one stage per rank, so "
                             f"virtual_stages={self.virtual_stages} needs a looped schedule "
                             f"instead: one of {list(LOOPED)}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"Layout: global_batch {self.global_batch} is not a multiple of "
                             f"dp × micro_batch = {self.dp} × {self.micro_batch}; each replica "
                             f"runs global_batch / (dp · micro_batch) whole micro-batches")
        if self.shard_gradients and not self.distributed_optimizer:
            raise ValueError("Layout: shard_gradients keeps only the slice of the gradients "
                             "that this replica's optimizer updates, so it needs "
                             "distributed_optimizer=True (the optimizer states sharded too)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Layout: sequence_parallel splits the sequence over the "
                             "tensor-parallel group, so it needs tp > 1")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline per step: m = global_batch / (dp · micro_batch)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.schedule in V_SHAPED else self.virtual_stages

    @property
    def chunks(self) -> int:
        """Model chunks (the schedule's stages): pp · chunks_per_rank."""
        return self.pp * self.chunks_per_rank


def check_fits(model: Model, layout: Layout) -> None:
    """Raise ValueError, naming what to change, if ``layout`` cannot split ``model``."""
    t = layout.tp
    if model.heads % t:
        raise ValueError(f"tp {t} does not divide heads {model.heads}: tensor parallelism "
                         f"gives each GPU heads / tp whole heads")
    if t % model.kv and model.kv % t:
        raise ValueError(f"tp {t} and kv_heads {model.kv}: one must divide the other "
                         f"(each GPU holds whole key-value heads, or shares one)")
    if model.ffn % t:
        raise ValueError(f"tp {t} does not divide ffn_hidden {model.ffn}")
    # the first and the last chunk may hold only the embedding and the loss (Llama 3)
    if model.layers < layout.chunks - 2 * (layout.chunks > 2):
        raise ValueError(f"{model.layers} layers cannot fill {layout.chunks} model chunks "
                         f"(pp {layout.pp} × {layout.chunks_per_rank} per rank, every chunk "
                         f"but the first and the last at least one layer): lower pp or "
                         f"virtual_stages")
    if layout.sequence_parallel and model.seq_len % t:
        raise ValueError(f"sequence_parallel: tp {t} does not divide seq_len {model.seq_len}")


def layers_per_chunk(layers: int, chunks: int) -> list[int]:
    """Split ``layers`` over ``chunks`` as evenly as possible; where it does not divide,
    the first and last chunks, which also hold the embedding and the loss, get fewer
    (as Llama 3's 126 layers on 16 stages: 7 on the first and last, 8 elsewhere; in 128
    chunks of one layer, the first holds only the embedding and the last only the loss,
    Dubey et al. 2024, Sec. 3.3.2)."""
    base, extra = divmod(layers, chunks)
    order = list(range(1, chunks - 1)) + [chunks - 1, 0] if chunks > 1 else [0]
    counts = [base] * chunks
    for c in order[:extra]:
        counts[c] += 1
    return counts
