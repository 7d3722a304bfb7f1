"""Pipeline parallelism across processes: the schedules the simulator draws, run by torchrun.

One process per pipeline rank. Rank ``r`` holds every stage ``s`` that the schedule places
there (``schedule.rank_of(s) == r``: ``s % pp`` for looped schedules, a V for ZB-V and
DualPipeV) and runs ``schedule.actions[r]`` with the loop the threaded `Pipe.step`
runs, `executor.run_program`, around which `pipeline_lib.step` does the same split, loss
scaling and gradient commit, with the same dropout seeds per (stage, micro-batch). Only
the way activations and gradients travel differs (`PointToPoint`, the transport), and
that is the lesson of this module.

Every process runs the same script under torchrun (``torchrun --nproc_per_node 4 -m
pipeline_lib.lm.train --pp 2 --dp 2`` trains the Transformer LM)::

    with process_group():                       # see `pipeline_lib.distributed.job`
        mesh = init_mesh(pp=2, dp=2)
        pipe = DistributedPipe(build_model(), mesh, balance=[5, 5], microbatches=8)
        optimizer = torch.optim.AdamW(pipe.parameters())
        for inputs, targets in batches:         # the same global batches on every rank
            optimizer.zero_grad()
            loss = pipe.step(inputs, targets, loss_fn)   # None except on the last stage
            optimizer.step()

Moving tensors between ranks
----------------------------
The tempting code posts each action's sends and receives together with
``dist.batch_isend_irecv`` and waits for all of them. That hangs on gloo, and it makes a
rank wait for its *sends*, i.e. for its neighbour to be ready to receive: the very idling
a schedule is designed to avoid. Instead, with plain ``isend``/``irecv`` on gloo and NCCL:

1. **Sends never wait.** A forward's output leaves with ``isend`` and the rank moves on to
   its next action. The handles and buffers are kept, and waited for when the step ends:
   one boundary tensor per micro-batch, little next to what a stage keeps for its backward.
2. **Receives are the only waits**, and a rank receives only what its next action needs.
3. **NCCL matches sends to receives by order, not by tag**, one operation after another
   on one stream per communicator. Two consequences:

   a. *One process group per direction.* If rank 0's activations to rank 1 and rank 1's
      gradients to rank 0 shared a communicator, rank 0 could queue [send activation,
      receive gradient] while rank 1 queues [send gradient, receive activation]: each
      send waits for a receive queued behind the other send, forever. So each pair of
      neighbours gets two 2-rank groups: everything ``a`` sends to ``b`` goes through one,
      everything ``b`` sends to ``a`` through the other (`mesh.Mesh.link`). A send and a
      receive in opposite directions never queue behind each other.
   b. *Receive in the sender's order.* Within one group, the k-th receive gets the k-th
      send. Every rank knows every rank's program, so it computes the exact sequence of
      messages a peer will send it (`p2p.send_order`). When an action needs a message,
      the rank receives that peer's messages in this order until it has the one it needs,
      and keeps earlier ones for the actions that need them later. In the built-in
      schedules messages happen to be needed in the order they are sent; a `Schedule` that
      consumes them in another order (rank 0 running ``0B1`` before ``0B0`` while rank 1
      sends the gradient of micro-batch 0 first) still works, by buffering.

   Since senders never wait, receiving a message early or buffering it never blocks
   anybody: a valid schedule cannot deadlock. Each message opens with a small header (which
   message it is, and each tensor's dtype and shape), so the receiver allocates exactly what
   comes, shapes may change from one micro-batch to the next, and a rank that is not running
   the same program is caught at its first message rather than filling a buffer with garbage.
4. **Receives are posted early** once shapes are known: in a step whose batch has the
   last step's shapes, a rank posts its receives before they are needed, at the sizes the
   last step's headers showed (`p2p.PostedEarly`), so a message costs no hand-shake when
   it is needed.

Data parallelism
----------------
With ``dp > 1`` replicas (`mesh` explains the layout), each stage module is wrapped in
PyTorch's `DistributedDataParallel` over the ranks holding the same stage, and each replica
trains on its slice of the global batch. DDP all-reduces the gradients during the backward
that follows a forward run with gradient sync on, but a pipeline runs other micro-batches'
backwards between a forward and its own backward. So, like torch.distributed.pipelining,
everything runs under ``no_sync()`` (gradients accumulate locally) and the reducer is armed
(``reducer.prepare_for_backward``) right before the last action that computes the stage's
weight gradients: its last B, or its last W for zero-bubble schedules, whose I computes
input gradients only and fires no DDP hook. That one backward then all-reduces, bucket by
bucket, overlapped with the rest of it. DDP averages over replicas, so each replica scales
its micro-batch losses by ``dp`` on top of the global-batch `loss_weights`: the average of
the replicas' gradients is then exactly the gradient of the global batch's mean loss. A
``loss_fn`` returning ``SumCount(loss_sum, count)`` backpropagates sums instead, and at the
end of the step every rank multiplies its gradients by dp / (the count of all replicas'
micro-batches together), which one all-reduce gives every rank (`pipeline_lib.loss`).

That armed backward must reach every parameter of the stage: DDP all-reduces a bucket
once all of its parameters' gradients are ready, so a parameter the forward never uses
would leave its bucket unreduced, each replica keeping its own gradients. The step checks
it and names such parameters at once, before any optimizer step (freeze or remove them).

Tied weights
------------
Stages on one rank share one parameter, as a V schedule's first and last stage share tied
input and output embeddings; `DistributedPipe.parameters` yields it once. Under DDP the
reducers of both stages average it over the replicas, one after the other: the first
makes the replicas agree on what had accumulated so far, and averaging values they agree
on changes nothing, so the second leaves the average of everything: exact. Stages on
different ranks would each hold a copy and get only their own share of its gradient:
that is refused when the pipe is built (`check_no_weight_shared_across_ranks`).

The same batch on every rank
----------------------------
Each step's first collective, the all-reduce that shares the step's seed, also compares
every rank's batch shapes, values and step number: one rank given a batch of other
shapes or values (other targets, rows in another order), or a step behind, makes every
rank raise, naming it. The values are compared by a fingerprint (`_fingerprint`), a few
passes over the batch's tensors where they are, read with the all-reduce's one read.

Timelines
---------
Every rank records when each of its actions ran, on a clock started at a barrier common to
all ranks. `DistributedPipe.gather_timeline` collects them on one rank as the same `Timeline`
the simulator returns, so a run is drawn and its bubble compared with one function.
"""
from __future__ import annotations

import contextlib
import hashlib
import pickle
from typing import Any, ContextManager, Iterator, Mapping, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib import tree
from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.checkpoint import check_mode
from pipeline_lib.deprecation import renamed_keywords
from pipeline_lib.devices import WithDevice
from pipeline_lib.distributed.mesh import Mesh, check_same_everywhere
from pipeline_lib.distributed.p2p import (Message, PostedEarly, Transport, batch_key,
                                          describe_tensors)
from pipeline_lib.executor import Received, Stopwatch, run_program
from pipeline_lib.loss import check_count, check_grad_mode
from pipeline_lib.microbatch import NoChunk
from pipeline_lib.partition import group_layers
from pipeline_lib.rng import new_step_seed, owned_rng, seed_for
from pipeline_lib.schedules import Action, Schedule, plan
from pipeline_lib.skip import skip_routes
from pipeline_lib.stage import LossFn, StageRunner
from pipeline_lib.step import local_loss, make_runners, split_batch, train_step
from pipeline_lib.timeline import Event, Timeline


class DistributedPipe:
    """This rank's share of a pipeline: its stages, and one `step` of the schedule.

    Every rank builds the same ``module`` (seed before building it) and passes the same
    arguments; each keeps only the stages of ``balance`` that live on it (stage ``s`` on
    pipe rank ``schedule.rank_of(s)``), moved to ``mesh.device``. ``schedule`` is a name of
    `schedules.BUILDERS` or a `Schedule` for ``mesh.pp`` ranks. ``post_early=False``
    sends every message as `p2p.Transport` does, header then tensors, each waiting for its
    receive: simpler to follow, slower for small stages (`p2p.PostedEarly` is the speed-up).
    What ``post_early=True`` asks in return: from the second step on, a batch with the
    shapes of the step before must give every message the shape that step's gave, which holds unless a stage's output shape depends on its input's values (a
    layer that drops padding tokens, say); such a stage raises `p2p.ProtocolError`
    saying so, and runs with ``post_early=False``.
    """

    @renamed_keywords(chunks="microbatches")
    def __init__(self, module: nn.Sequential, mesh: Mesh, balance: Sequence[int],
                 microbatches: int, schedule: str | Schedule = "1f1b",
                 checkpoint: str = "never", post_early: bool = True):
        stages = group_layers(module, balance)
        check_runs_in_processes(module, balance)
        self.mesh, self.checkpoint = mesh, check_mode(checkpoint)
        self.schedule = plan(schedule, mesh.pp, len(stages), microbatches)
        check_same_everywhere("pipelines", dict(
            schedule=self.schedule.name, grid=self.schedule.grid(), pp=mesh.pp, dp=mesh.dp,
            balance=list(balance), checkpoint=checkpoint, post_early=post_early))
        check_no_weight_shared_across_ranks(module, stages, self.schedule)
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.steps = 0   # calls of `step` so far: the ranks must agree (`_agree`)
        self.program = self.schedule.actions[mesh.pipe_rank]
        self.modules = {s: self._replicated(stages[s].to(mesh.device))
                        for s in range(len(stages)) if self.schedule.rank_of(s) == mesh.pipe_rank}
        # Per replicated stage, the backward whose weight gradients DDP all-reduces: the
        # stage's last B (or W), when every micro-batch's gradients have accumulated.
        self.sync_at = {a.stage: a for a in self.program if a.kind in ("B", "W")
                        and isinstance(self.modules[a.stage], DistributedDataParallel)}
        self.transport = (PostedEarly if post_early else Transport)(mesh, self.schedule)
        self.link = PointToPoint(self.transport, self.schedule, mesh)
        self.events: list[Event] = []

    def _replicated(self, stage: nn.Module) -> nn.Module:
        if self.mesh.dp == 1 or not any(p.requires_grad for p in stage.parameters()):
            return stage
        cuda = self.mesh.device.type == "cuda"
        # Buffers are made equal once, at construction; syncing them on every forward
        # would be one more collective per micro-batch.
        return DistributedDataParallel(stage, device_ids=[self.mesh.device] if cuda else None,
                                       process_group=self.mesh.dp_group,
                                       forward_sync_buffers=False)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "a DistributedPipe runs training steps, pipe.step(inputs, target, loss_fn); "
            "pipe(x), a pipelined forward connected to autograd (the classic API), is the "
            "threaded Pipe's (pipeline_lib.Pipe, one process)")

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (for its optimizer), each once: a weight tied between
        two stages of this rank (a V schedule's first and last) is one parameter."""
        seen: set[int] = set()
        for module in self.modules.values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    # -- one step ------------------------------------------------------------------------

    def step(self, inputs: Any, target: Any, loss_fn: LossFn) -> Tensor | None:
        """Forward and backward of the global batch ``(inputs, target)`` (the same on every
        rank: each replica takes its slice, stage 0 reads the inputs, the last stage the
        targets). Gradients accumulate as in `Pipe.step`; returns the global batch's loss
        on the ranks holding the last stage, None on the others. Inputs, targets and the
        activations between stages may be trees (see `microbatch.split`), and ``loss_fn``
        may return a mean or a ``SumCount(loss_sum, count)`` (see `pipeline_lib.loss`).
        An input tensor that requires grad gets its ``.grad`` where stage 0 runs: on each
        replica's rank holding stage 0, the batch loss's gradient for the replica's rows
        (zeros in the others' rows: the replicas' ``x.grad`` add up to the unpipelined
        model's; all-reduce them over ``mesh.dp_group`` for the whole); on the other ranks
        none is added.

        If the step fails on any rank, every rank raises (the others once that rank's
        process has ended, as `job.process_group` ends it) and ``.grad`` is left as it was."""
        check_grad_mode("DistributedPipe.step")
        schedule, mesh = self.schedule, self.mesh
        step_seed, key = self._agree(inputs, target)
        micro_in, micro_target, weights = split_batch(inputs, target, schedule.microbatches,
                                                      mesh.dp, mesh.replica)
        last = schedule.stages - 1
        runners = make_runners({s: (module, mesh.device) for s, module in self.modules.items()},
                               last, self.checkpoint, schedule.microbatches, step_seed,
                               loss_fn, weights, rng=owned_rng, inputs=inputs)

        def run() -> tuple[Tensor | None, float]:
            self.transport.start_step(key)
            stopwatch = Stopwatch(mesh.rank, mesh.device, mesh.clock)
            with contextlib.ExitStack() as no_sync:   # DDP: see the module docstring
                for module in self.modules.values():
                    if isinstance(module, DistributedDataParallel):
                        no_sync.enter_context(module.no_sync())
                try:
                    run_program(self.program, runners, last, micro_in, micro_target,
                                self.link, stopwatch, schedule.name, around=self._armed)
                finally:
                    self.events = stopwatch.events()
            self.transport.finish_step()
            loss, scale = self._loss(runners.get(last))
            if 0 in runners:   # DDP averaged the replicas' sums, which x.grad skips
                runners[0].backward_into_caller(scale / mesh.dp)
            return loss, scale

        return train_step(self.parameters(), run)

    def _agree(self, inputs: Any, target: Any) -> tuple[int, int]:
        """The step's seed and `p2p.batch_key`, the same on every rank, after checking
        that every rank was given a batch of the same shapes and is at the same step.

        One all-reduce (MAX) does it all: rank 0's seed (the others send -1), so dropout
        agrees across stages even if the ranks' random generators have drifted apart;
        and each rank's key and step number, with their negatives, whose maxima give the
        smallest and the largest value over the ranks. Replica 0 uses the seed as it is,
        like `Pipe.step`; the others derive their own, for dropout masks independent of
        replica 0's."""
        mesh = self.mesh
        self.steps += 1
        key = batch_key(_shapes(inputs), _shapes(target))
        seed = new_step_seed() if mesh.rank == 0 else -1
        values = _fingerprint((inputs, target))   # where the batch is: no read, no copy
        sent = torch.cat([torch.tensor([seed, key, -key, self.steps, -self.steps],
                                       dtype=torch.int64, device=values.device),
                          torch.stack([values, -values])]).to(mesh.device)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        step_seed, most_key, least_key, most_steps, least_steps, most, least = sent.tolist()
        if most_key != -least_key or most_steps != -least_steps or most != -least:
            self._disagreement(inputs, target)
        if mesh.replica > 0:
            step_seed = seed_for(step_seed, -1, mesh.replica)
        return step_seed, key

    def _disagreement(self, inputs: Any, target: Any) -> NoReturn:
        """Raise on every rank, naming the ranks whose batch or step number differ from
        rank 0's (every rank calls this: all saw the same all-reduce)."""
        mine = (self.steps, describe_tensors(_shapes(inputs)),
                describe_tensors(_shapes(target)), _fingerprint(inputs).item(),
                _fingerprint(target).item())
        seen: list[tuple[int, str, str, int, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)

        def values(r: int) -> str:   # where rank r's shapes are rank 0's
            return "".join(f", {what} values other than rank 0's"
                           for what, shapes, fingerprint in (("input", 1, 3), ("target", 2, 4))
                           if r and seen[r][shapes] == seen[0][shapes]
                           and seen[r][fingerprint] != seen[0][fingerprint])

        said = [f"rank {r} is at step {steps} with inputs {x} and target {y}{values(r)}"
                for r, (steps, x, y, *_) in enumerate(seen) if r == 0 or seen[r] != seen[0]]
        raise ValueError(f"the ranks were given different batches or are at different steps: "
                         f"{'; '.join(said)}. Every rank must call step the same number of "
                         f"times with the same global batch, shapes and values (each replica "
                         f"takes its slice; a DistributedSampler that gives each rank its own "
                         f"rows is not what DistributedPipe needs)")

    def _armed(self, action: Action) -> ContextManager[None]:
        """The block an action's backward runs in: DDP's all-reduce armed for the stage's
        last backward of the step (see the module docstring), nothing for the others."""
        if self.sync_at.get(action.stage) == action:
            return self._all_reducing(action.stage)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _all_reducing(self, stage: int) -> Iterator[None]:
        """Arm DDP's reducer of ``stage`` for the backward run in the block, and check that
        it reached every parameter: DDP all-reduces a bucket once each of its parameters'
        gradient is ready, so a parameter that this backward does not reach (one that
        the forward never uses, or that the last micro-batch does not use) would leave
        its bucket local to each replica, and the replicas would drift apart."""
        module = self.modules[stage]
        params = [p for p in module.parameters() if p.requires_grad]
        reached: set[int] = set()
        hooks = [p.register_post_accumulate_grad_hook(lambda p: reached.add(id(p)))
                 for p in params]
        try:
            module.reducer.prepare_for_backward([])
            yield
        finally:
            for hook in hooks:
                hook.remove()
        missed = [self.names[id(p)] for p in params if id(p) not in reached]
        if missed:
            raise RuntimeError(
                f"parameters {missed} of stage {stage} got no gradient in the stage's last "
                f"backward of the step, during which DistributedDataParallel all-reduces "
                f"its gradients over the {self.mesh.dp} replicas: their gradients (and "
                f"those sharing a DDP bucket with them) would stay each replica's own. "
                f"Use these parameters in every micro-batch's forward, remove them, or "
                f"freeze them (p.requires_grad_(False)) before building DistributedPipe")

    def _loss(self, runner: StageRunner | None) -> tuple[Tensor | None, float]:
        """The batch's loss on the ranks holding the last stage (None on the others), and
        the factor every rank multiplies the gradients of the step by.

        For mean losses the factor is 1: the weights did the scaling. For ``(loss_sum,
        count)`` pairs only the last stage knows the counts, but every stage must divide
        by their total over all micro-batches of all replicas: one all-reduce over every
        rank gives it to all. The factor is dp / total, since DDP averaged the replicas'
        sums."""
        mesh, m = self.mesh, self.schedule.microbatches
        loss, count = local_loss([runner.losses[i] for i in range(m)]) if runner is not None \
            else (None, None)
        agreed = torch.tensor([0.0 if count is None else count.item(), float(count is not None)],
                              dtype=torch.float64, device=mesh.device)
        dist.all_reduce(agreed)   # [total count, replicas whose loss_fn returned counts]
        total, counted = agreed.tolist()
        if counted not in (0, mesh.dp):
            raise RuntimeError(f"loss_fn returned SumCount(loss_sum, count) on {counted:g} of "
                               f"the {mesh.dp} replicas and means on the others; return the "
                               f"same kind everywhere")
        if counted:
            check_count(total)
        scale = mesh.dp / total if counted else 1.0
        if loss is None:
            return None, scale
        if mesh.dp > 1:
            if not counted:   # undo the dp scaling of the weights
                loss = loss / mesh.dp
            dist.all_reduce(loss, group=mesh.dp_group)   # sum over replicas
        return (loss / total if counted else loss), scale

    # -- timelines -----------------------------------------------------------------------

    def gather_timeline(self, dst: int = 0) -> Timeline | None:
        """The last step's actions of every rank, as one `Timeline` on global rank ``dst``
        (None elsewhere); rows are global ranks. Every rank must call it."""
        gathered: list[list[Event]] | None = [[] for _ in range(dist.get_world_size())] \
            if self.mesh.rank == dst else None
        dist.gather_object(self.events, gathered, dst=dst)
        if gathered is None:
            return None
        events = sorted((e for rank_events in gathered for e in rank_events),
                        key=lambda e: (e.start, e.rank))
        title = f"{self.schedule.name}, {self.mesh.pp} processes"
        if self.mesh.dp > 1:
            title += f" × {self.mesh.dp} replicas"
        return Timeline(len(gathered), events, unit="s", title=title).shifted()


def check_runs_in_processes(module: nn.Sequential, balance: Sequence[int]) -> None:
    """Refuse, before any rank talks to another, what only the threaded `Pipe` runs:
    skip connections between stages, `DeferredBatchNorm` and `WithDevice` layers. Each
    message names `Pipe` (the README's feature table lists what runs where)."""
    layer_stage = [s for s, count in enumerate(balance) for _ in range(count)]
    crossing = skip_routes(module, layer_stage)
    if crossing:
        raise NotImplementedError(
            f"skip connections between stages ({crossing}) are not sent between "
            f"processes yet; choose a balance that keeps each within one stage, or use Pipe")
    for name, layer in module.named_modules():
        if isinstance(layer, DeferredBatchNorm):
            raise NotImplementedError(
                f"layer {name} is a DeferredBatchNorm, which the threaded Pipe runs "
                f"(Pipe(..., deferred_batch_norm=True)) but DistributedPipe does not yet: "
                f"its running statistics would be each replica's own, and a failed step's "
                f"micro-batches would stay counted. Use Pipe, or nn.BatchNorm layers")
        if isinstance(layer, WithDevice):
            raise NotImplementedError(
                f"layer {name} is a WithDevice({layer.device}), which places a stage on a "
                f"device of one process, as the threaded Pipe does; DistributedPipe puts "
                f"every stage of a rank on that rank's mesh.device. Unwrap it "
                f"({name}.module), or use Pipe")


def check_no_weight_shared_across_ranks(module: nn.Module, stages: Sequence[nn.Module],
                                        schedule: Schedule) -> None:
    """Refuse a trainable weight used by stages on different ranks (tied input and output
    embeddings, the common LM case): each process would hold its own copy, each copy
    would get only its own stage's share of the gradient, and the copies would drift
    apart. Stages on one rank share the one parameter, which is exact. Parameters that
    share storage count as one weight."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    weights: dict[tuple[str, int], dict[int, nn.Parameter]] = {}   # storage -> users
    stages_of: dict[tuple[str, int], set[int]] = {}
    for s, stage in enumerate(stages):
        for p in stage.parameters():
            address = p.untyped_storage().data_ptr()
            if address == 0:   # no storage (empty, or on the meta device): nothing shared
                continue
            where = (str(p.device), address)
            weights.setdefault(where, {})[id(p)] = p
            stages_of.setdefault(where, set()).add(s)
    problems = []
    for where, users in weights.items():
        ranks = {schedule.rank_of(s) for s in stages_of[where]}
        if len(ranks) > 1 and any(p.requires_grad for p in users.values()):
            named = [n for i in users for n in names[i]]
            placed = ", ".join(f"stage {s} on pipe rank {schedule.rank_of(s)}"
                               for s in sorted(stages_of[where]))
            problems.append(f"{' = '.join(named)} is used by {placed}")
    if problems:
        raise ValueError(
            f"a weight is shared by stages on different ranks of {schedule.name}: "
            f"{'; '.join(problems)}. Each process would hold its own copy, get only its "
            f"own stages' share of the gradient, and the copies would drift apart. Use "
            f"the threaded Pipe (one process holds the one weight), a schedule or balance "
            f"that puts these stages on one rank (a V schedule such as zb_v holds the first "
            f"and the last stage on rank 0), or untie the weights (a Parameter of its own "
            f"per stage); to train untied copies as one weight, as Megatron-LM does for its "
            f"embeddings, start them equal and all-reduce their gradients over the ranks "
            f"holding a copy after each step")


def _shapes(batch: Any) -> tuple[Any, ...]:
    """A batch's leaves, with `NoChunk` tensors unwrapped: what `describe_tensors` and
    `batch_key` read (the shape of a NoChunk mask matters as much as the others')."""
    return tuple(leaf.tensor if isinstance(leaf, NoChunk) else leaf
                 for leaf in tree.leaves(batch))


def _fingerprint(batch: Any) -> Tensor:
    """A number (int64, 0-dim, where the batch's first tensor is) that every value of the
    batch's tensors and its position change: Σ bits(v_ij)·(1 + i·C + j) over each tensor
    seen as rows × C columns, from its row and column sums. On the values' bit patterns,
    in integers, so that it is exact and the same whatever order a device adds in;
    computed where the tensors are, without reading them to the host: a few elementwise
    passes over the batch (a token batch: well under a millisecond). A number, string,
    flag or None in the batch counts by its repr."""
    leaves = _shapes(batch)
    device = next((t.device for t in leaves if isinstance(t, Tensor)), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.int64, device=device)
    for t in leaves:
        if isinstance(t, (str, int, float, type(None))):   # bool is an int
            digest = hashlib.blake2b(repr(t).encode(), digest_size=7).digest()
            total = total * 1_000_003 + int.from_bytes(digest, "little")
        if not isinstance(t, Tensor):
            continue
        t = t.detach().resolve_conj().resolve_neg()   # the values, not a lazy view of them
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.is_floating_point() or t.dtype == torch.bool:
            t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                        8: torch.int64}[t.element_size()])
        rows = t.shape[0] if t.dim() else 1
        columns = t.numel() // rows if rows else 0
        grid = t.reshape(rows, columns)
        # Summed in the bits' own width, wrapping: exact all the same (a sum modulo 2^k
        # does not depend on the order), and faster than widening every element. The
        # top bit folded into the lower half first: else two sign flips in a row (y
        # against -y) would change its sum by 2^k, which wraps to nothing.
        grid = grid ^ (grid >> 4 * grid.element_size())
        by_row, by_column = (grid.sum(dim, dtype=grid.dtype).long() for dim in (1, 0))
        mixed = (by_row.sum() + columns * (by_row * torch.arange(rows, device=t.device)).sum()
                 + (by_column * torch.arange(columns, device=t.device)).sum())
        total = total * 1_000_003 + mixed.to(device)
    return total & (2**62 - 1)   # its negative fits in an int64 too


class PointToPoint:
    """The `executor.Transport` between processes: activations and gradients as
    `p2p.Message`s to and from the neighbouring stages' ranks (``p2p`` moves them).
    Skip connections never cross a process (`DistributedPipe` refuses them)."""

    def __init__(self, transport: Transport, schedule: Schedule, mesh: Mesh):
        self.transport, self.rank_of, self.mesh = transport, schedule.rank_of, mesh
        self.last = schedule.stages - 1
        self.where = f"rank {mesh.rank} (replica {mesh.replica}, pipe rank {mesh.pipe_rank})"

    def receive(self, action: Action) -> Received:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s > 0:
            message = Message("activation", s, i)
            return _unpacked(self.transport.receive(self.rank_of(s - 1), message)), {}
        if action.kind in ("B", "I") and s < self.last:
            return self.transport.receive(self.rank_of(s + 1), Message("gradient", s, i)), {}
        return None, {}

    def send(self, action: Action, value: Any, skips: Mapping[Any, Any]) -> None:
        s, i = action.stage, action.microbatch
        if action.kind == "F":
            self.transport.send(self.rank_of(s + 1), Message("activation", s + 1, i),
                                _packed(value, self.mesh.device))
        else:   # as the tuple of its leaves: stage s - 1 made the activation, so it
            # knows the structure (see `StageRunner`)
            self.transport.send(self.rank_of(s - 1), Message("gradient", s - 1, i),
                                tuple(tree.leaves(value)))

    def input_note(self, action: Action, value: Any) -> str:
        s = action.stage
        return (f"stage {s}'s input for micro-batch {action.microbatch}, from stage {s - 1} "
                f"on pipe rank {self.rank_of(s - 1)}, was {describe_tensors(value)}")


class _Slot:
    """Stands for a tensor in the skeleton of an activation sent to another process."""


def _packed(activation: Any, device: torch.device) -> Any:
    """What crosses a process boundary for an activation: a tensor as it is; any other
    tree as its skeleton (the tree with a `_Slot` for each tensor, pickled into a uint8
    tensor), then its tensors, so that the receiver rebuilds dicts, lists and non-tensor
    leaves. Reading the skeleton back costs a device-to-host copy on GPUs."""
    if isinstance(activation, Tensor):
        return activation
    skeleton = pickle.dumps(tree.map_tensors(lambda _: _Slot(), activation))
    return (torch.tensor(list(skeleton), dtype=torch.uint8, device=device),
            *tree.tensors(activation))


def _unpacked(message: Any) -> Any:
    """The activation `_packed` sent."""
    if isinstance(message, Tensor):
        return message
    skeleton, *tensors = message
    it = iter(tensors)
    return tree.map_leaves(lambda leaf: next(it) if isinstance(leaf, _Slot) else leaf,
                           pickle.loads(bytes(skeleton.tolist())))
