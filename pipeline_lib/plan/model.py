"""What is trained and how it is laid out: `Model` (a decoder-only Transformer) and
`Layout` (tensor × context × pipeline × data parallelism, micro-batch, schedule,
recompute, what the data dimension shards, what overlaps)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
    matrices of ``hidden × ffn_hidden``; Llama) instead of two (GPT).
    ``tied_embeddings``: the output projection is the input embedding (GPT-2/3,
    Megatron-LM's default) or a matrix of its own (Llama: V·h more weights, which the
    last pipeline stage holds and updates either way). ``dropout``: whether
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
    tied_embeddings: bool = True

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
        """All parameters: the blocks, the vocabulary embedding and, when it is not tied
        to the embedding, the output projection."""
        embeddings = 1 if self.tied_embeddings else 2
        return self.layers * self.layer_parameters() + embeddings * self.vocab * self.hidden

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
    """How ``tp × cp × pp × dp`` GPUs train a model.

    The names are the ones a runtime uses for the same things (Megatron-LM's arguments,
    PyTorch's FSDP2), so that a layout planned here configures a run:

    * ``tp``, ``cp``, ``pp``, ``dp``: tensor, context, pipeline and data parallelism.
      Context parallelism splits each sequence over ``cp`` GPUs (ring attention: each
      holds s/cp tokens and passes its keys and values around the ring; Liu et al. 2023,
      Megatron-LM's ``--context-parallel-size``); the gradients are reduced over the
      ``dp · cp`` GPUs that hold the same weights.
    * ``schedule`` names a builder of `pipeline_lib.schedules` (gpipe, 1f1b, zb_h1, zb_h2,
      interleaved_1f1b, interleaved_zero_bubble, looped_bfs, zb_v, dualpipe_v). Looped
      schedules put ``virtual_stages`` stages (model chunks) on each pipeline rank,
      V-shaped ones 2. ``first_stage_layers`` and ``last_stage_layers`` set the layers of
      the first and the last stage (Megatron-LM's ``--decoder-first-pipeline-num-layers``
      and ``--decoder-last-pipeline-num-layers``; Llama 3 gives them one fewer, for the
      embedding and the loss they also hold); the others share the rest evenly. None:
      all stages as even as the layers allow, the first and the last taking fewer.
    * ``recompute``: "none", "selective" (the attention core, Korthikanti et al. 2022)
      or "full" (each layer's forward again before its backward).
      ``flash_attention``: the attention core fused into one kernel that never writes
      the s × s scores (Dao et al. 2022; Megatron-LM's 2021 runs predate it).
      ``sequence_parallel``: the norms, dropouts and residuals split over the sequence
      within the tensor-parallel group (Korthikanti et al. 2022).
    * Data parallelism and what it shards, ZeRO's stages (Rajbhandari et al. 2020):
      ``distributed_optimizer`` shards the optimizer states (stage 1; Megatron-LM's
      ``--use-distributed-optimizer``), ``shard_gradients`` the gradients too (stage 2),
      ``shard_parameters`` the 16-bit weights too (stage 3, FSDP: each layer's weights
      all-gathered before its forward and its backward, its gradients reduce-scattered
      after each micro-batch's backward), ``reshard_after_forward`` (FSDP2's name)
      whether they are freed after the forward and gathered again for the backward
      (Llama 3 keeps them: Dubey et al. 2024, Sec. 3.3.1). ``overlap_grad_reduce`` and
      ``overlap_param_gather`` (Megatron-LM's ``--overlap-grad-reduce`` and
      ``--overlap-param-gather``): the gradient reduction runs bucket by bucket during
      the last backwards, and the distributed optimizer's all-gather of the updated
      weights during the next step's first forwards, instead of after them.
    * ``bytes_per_parameter``: the model states' two conventions. 16 is ZeRO's count
      (16-bit weights and gradients, 32-bit master weights and two Adam moments: 2 + 2 +
      12, Rajbhandari et al. 2020, Sec. 3.1); 18 is Megatron-LM's (gradients accumulated
      and reduced in 32 bits, ``--accumulate-allreduce-grads-in-fp32``: 2 + 4 + 12,
      ``megatron/training/theoretical_memory_usage.py``).
    * ``tp_comm_overlap``: the tensor-parallel all-gathers and reduce-scatters run in
      chunks under the matrix multiplies next to them (Megatron-LM's
      ``--tp-comm-overlap``, PyTorch's AsyncTP; Wang et al. 2023); needs sequence
      parallelism. ``fp8``: the Transformer layers' matrix multiplies in FP8 (Transformer
      Engine; the attention core and the vocabulary projection stay 16-bit), at the
      cluster's ``fp8_flops``.
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
    cp: int = 1
    shard_parameters: bool = False
    reshard_after_forward: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    bytes_per_parameter: int = 16
    tp_comm_overlap: bool = False
    fp8: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "dp", "micro_batch", "global_batch", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout: {name} must be a positive integer, got {value!r}")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"Layout: {name} must be None (an even split) or an "
                                 f"integer >= 0, got {value!r}")
        if self.schedule not in BUILDERS:
            raise ValueError(f"Layout: unknown schedule {self.schedule!r}; choose one of "
                             f"{sorted(BUILDERS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout: recompute must be one of {RECOMPUTE}, "
                             f"got {self.recompute!r}")
        if self.bytes_per_parameter not in BYTES_PER_PARAMETER:
            raise ValueError(f"Layout: bytes_per_parameter is 16 (ZeRO's count: 16-bit "
                             f"gradients) or 18 (Megatron-LM's: 32-bit gradients), got "
                             f"{self.bytes_per_parameter!r}")
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
        if self.shard_parameters and not self.shard_gradients:
            raise ValueError("Layout: shard_parameters (ZeRO stage 3, FSDP) shards the "
                             "gradients and optimizer states too: set shard_gradients=True "
                             "and distributed_optimizer=True as well")
        if not self.reshard_after_forward and not self.shard_parameters:
            raise ValueError("Layout: reshard_after_forward=False keeps gathered weights "
                             "between forward and backward, which only sharded weights "
                             "have: it needs shard_parameters=True")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("Layout: overlap_param_gather overlaps the distributed "
                             "optimizer's all-gather of the updated weights; it needs "
                             "distributed_optimizer=True")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Layout: sequence_parallel splits the sequence over the "
                             "tensor-parallel group, so it needs tp > 1")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("Layout: tp_comm_overlap overlaps the all-gathers and "
                             "reduce-scatters of sequence parallelism with the matrix "
                             "multiplies: it needs sequence_parallel=True (and tp > 1)")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

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

    @property
    def zero_stage(self) -> int:
        """ZeRO's stage: 0 (replicas hold everything) to 3 (weights sharded too)."""
        return (self.distributed_optimizer + self.shard_gradients + self.shard_parameters)

    @property
    def replicas(self) -> int:
        """GPUs that hold the same weights and reduce their gradients together: dp · cp."""
        return self.dp * self.cp


BYTES_PER_PARAMETER = (16, 18)


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
    layers_per_chunk(model.layers, layout.chunks, layout.first_stage_layers,
                     layout.last_stage_layers)
    split = t * layout.cp if layout.sequence_parallel else layout.cp
    if model.seq_len % split:
        what = (f"tp × cp = {t} × {layout.cp}" if layout.sequence_parallel
                else f"cp {layout.cp}")
        raise ValueError(f"{what} does not divide seq_len {model.seq_len}: sequence "
                         f"{'and context ' if layout.cp > 1 and layout.sequence_parallel else ''}"
                         f"parallelism give each GPU an equal share of the tokens")


def layers_per_chunk(layers: int, chunks: int, first: int | None = None,
                     last: int | None = None) -> list[int]:
    return list(_layers_per_chunk(layers, chunks, first, last))


@lru_cache(maxsize=4096)
def _layers_per_chunk(layers: int, chunks: int, first: int | None = None,
                      last: int | None = None) -> tuple[int, ...]:
    """Split ``layers`` over ``chunks`` (the schedule's stages). ``first`` and ``last``
    fix the first and the last chunk's (Megatron-LM's ``--decoder-first-pipeline-num-
    layers``); the rest share the others as evenly as possible. Where it does not
    divide, the first and last chunks, which also hold the embedding and the loss, get
    fewer (as Llama 3's 126 layers on 16 stages: 7 on the first and last, 8 elsewhere;
    in 128 chunks of one layer, the first holds only the embedding and the last only the
    loss, Dubey et al. 2024, Sec. 3.3.2). Raises ValueError if a chunk but the first and
    the last would hold no layer."""
    if chunks == 1:
        if first not in (None, layers) or last not in (None, layers):
            raise ValueError(f"one stage holds all {layers} layers: first_stage_layers "
                             f"and last_stage_layers must be None or {layers}")
        return (layers,)
    middle = chunks - 2
    fixed = (first or 0) + (last or 0)
    free = middle + (first is None) + (last is None)
    if fixed > layers or (free == 0 and fixed != layers):
        raise ValueError(f"first_stage_layers {first} and last_stage_layers {last} do not "
                         f"leave the other stages the rest of {layers} layers")
    base, extra = divmod(layers - fixed, free) if free else (0, 0)
    # the extra layers go to the middle stages first, then the last, then the first
    counts = [base] * chunks
    for c in range(1, 1 + min(extra, middle)):
        counts[c] += 1
    spare = extra - min(extra, middle)
    for c in ([chunks - 1] if last is None else []) + ([0] if first is None else []):
        if spare:
            counts[c] += 1
            spare -= 1
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if middle and base == 0 and extra < middle:
        raise ValueError(f"{layers} layers cannot fill {chunks} model chunks (every chunk "
                         f"but the first and the last at least one layer): lower pp or "
                         f"virtual_stages")
    return tuple(counts)
