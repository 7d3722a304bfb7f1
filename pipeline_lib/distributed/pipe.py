"""Pipeline parallelism across processes: the schedules the simulator draws, run by torchrun.

One process per pipeline rank. Rank ``r`` holds every stage ``s`` that the schedule places
there (``schedule.rank_of(s) == r``: ``s % pp`` for looped schedules, a V for ZB-V and
DualPipeV) and runs its program of the lowered schedule (`lowering.lower`: each compute
action with the messages it receives and sends) with the loop the threaded `Pipe.step`
runs, `executor.run_program`, around which `pipeline_lib.step` does the same split, loss
scaling and gradient commit, with the same dropout seeds per (stage, micro-batch). Only
the way messages travel differs (`p2p.PointToPoint`, the transport), and that is the
lesson of this module.

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
   The lowering checked, when the pipe was built, that ranks waiting only for their
   receives cannot deadlock (`lowering.validate_lowered`).
3. **NCCL matches sends to receives by order, not by tag**, one operation after another
   on one stream per communicator. Hence one process group per direction between two
   ranks (`mesh.Mesh.channel`, made for the pairs the lowered programs use: neighbours,
   the ring's closing pair, and any two ranks a skip connection joins), and receives in
   the sender's order (`lowering.LoweredSchedule.channel`), keeping early arrivals for the
   actions that need them. `p2p` explains both, and why neither can hang.
4. **Each message opens with its layout** (which message, each tensor's dtype and shape)
   in the first step with a batch of given shapes; later steps with those shapes send
   only the tensors, into receives sized from the agreed layout and, on gloo, posted
   before they are needed (`p2p.PostedEarly`): no host read per message on a GPU.

Skip connections (`skip.skippable`) travel the same way: each stashed tensor goes
straight from the stashing stage's rank to the popping stage's, and its gradient straight
back, as messages of their own.

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

Three dimensions
----------------
On a mesh with ``tp > 1`` (`mesh.init_mesh(..., tp=)`) each stage is laid out by
`parallel.block.shardable` and split over its tensor-parallel group by PyTorch's plans
(`parallel.tensor_parallel`): heads, MLP units and the vocabulary. Without
``sequence_parallel`` a message between stages on different ranks leaves each tp rank
as ``1/t`` of the activation and is all-gathered by the receiving group (Megatron-LM's
scatter/gather, `parallel.boundaries`); with it, each tp rank sends its own positions.
The logits stay split over the vocabulary: the loss runs under ``loss_parallel``, and
the norms' gradients, partial sums per tp rank, are summed once a step. DDP refuses the
split weights, so the replicas are ``replicate``, DDP's all-reduce on FSDP's machinery;
``shard_parameters=True`` shards them instead (FSDP2, ``fully_shard`` per layer),
resharded after each forward unless ``reshard_after_forward=False`` or the schedule
splits its backward (W needs the weights I used). Either way gradients accumulate
through the step and are reduced once, after the stage's last backward, as DDP's are
(`parallel.fsdp`).

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
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterator, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib import tree
from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.checkpoint import check_mode
from pipeline_lib.deprecation import renamed_keywords
from pipeline_lib.devices import WithDevice, read_back, transfer
from pipeline_lib.distributed.mesh import Mesh, check_same_everywhere
from pipeline_lib.distributed.p2p import PointToPoint, PostedEarly, batch_key, describe_tensors
from pipeline_lib.executor import Stopwatch, run_program
from pipeline_lib.loss import check_count, check_grad_mode
from pipeline_lib.lowering import lower
from pipeline_lib.microbatch import NoChunk
from pipeline_lib.parallel.block import shardable
from pipeline_lib.parallel.boundaries import split_at_boundaries
from pipeline_lib.partition import group_layers
from pipeline_lib.rng import new_step_seed, owned_rng, seed_for
from pipeline_lib.schedules import Action, Schedule, plan, splits_backward
from pipeline_lib.sharded import is_dtensor, is_fsdp_module
from pipeline_lib.skip import describe, skip_routes
from pipeline_lib.stage import LossFn, StageRunner
from pipeline_lib.step import local_loss, make_runners, split_batch, train_step
from pipeline_lib.timeline import Event, Timeline


class DistributedPipe:
    """This rank's share of a pipeline: its stages, and one `step` of the schedule.

    Every rank builds the same ``module`` (seed before building it) and passes the same
    arguments; each keeps only the stages of ``balance`` that live on it (stage ``s`` on
    pipe rank ``schedule.rank_of(s)``), moved to ``mesh.device``. ``schedule`` is a name of
    `schedules.BUILDERS` or a `Schedule` for ``mesh.pp`` ranks. Skip connections
    (`skip.skippable`) may cross stages and ranks. ``post_early=False`` sends every
    message as `p2p.PointToPoint` does, its layout then its tensors, each waiting for its
    receive: simpler to follow, slower for small stages, and a host read per message on
    a GPU (`p2p.PostedEarly` is the speed-up). What ``post_early=True`` asks in return: a
    batch with the shapes of an earlier step's must give every message the layout
    (shapes, dtypes, and any value that is not a tensor) that step's gave, which holds
    unless a stage's output depends on its input's values (a layer that drops padding
    tokens, say); such a stage raises `p2p.ProtocolError` saying so, and runs with
    ``post_early=False``. ``sequence_parallel``, ``shard_parameters`` and
    ``reshard_after_forward`` choose how the stages use a ``tp × pp × dp`` mesh (see the
    module docstring).
    """

    @renamed_keywords(chunks="microbatches")
    def __init__(self, module: nn.Sequential, mesh: Mesh, balance: Sequence[int],
                 microbatches: int, schedule: str | Schedule = "1f1b",
                 checkpoint: str = "never", post_early: bool = True, *,
                 sequence_parallel: bool = False, shard_parameters: bool = False,
                 reshard_after_forward: bool = True):
        stages = group_layers(module, balance)
        check_runs_in_processes(module)
        check_data_layout(mesh, sequence_parallel, shard_parameters, reshard_after_forward)
        self.mesh, self.checkpoint = mesh, check_mode(checkpoint)
        self.sequence_parallel, self.shard_parameters = sequence_parallel, shard_parameters
        self.reshard_after_forward = reshard_after_forward
        self.schedule = plan(schedule, mesh.pp, len(stages), microbatches)
        routes = skip_routes(module, [s for s, count in enumerate(balance) for _ in range(count)])
        check_same_everywhere("pipelines", dict(
            schedule=self.schedule.name, grid=self.schedule.grid(), pp=mesh.pp, dp=mesh.dp,
            tp=mesh.tp, balance=list(balance), checkpoint=checkpoint, post_early=post_early,
            sequence_parallel=sequence_parallel, shard_parameters=shard_parameters,
            reshard_after_forward=reshard_after_forward,
            skips=[(describe(r.key), r.source, r.target) for r in routes]))
        check_no_weight_shared_across_ranks(module, stages, self.schedule)
        if mesh.tp > 1 and routes:
            raise NotImplementedError("skip connections between tensor-parallel stages are "
                                      "not supported: run with tp = 1")
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.steps = 0   # calls of `step` so far: the ranks must agree (`_agree`)
        self.lowered = lower(self.schedule, routes)
        self.program = self.lowered.programs[mesh.pipe_rank]
        self.modules = {s: self._placed(s, stages[s]) for s in range(len(stages))
                        if self.schedule.rank_of(s) == mesh.pipe_rank}
        # Per replicated stage, the backward after which its gradients are reduced over
        # the replicas: the stage's last B (or W), when every micro-batch's gradients
        # have accumulated.
        self.sync_at = {step.action.stage: step.action for step in self.program
                        if step.action.kind in ("B", "W")
                        and (isinstance(self.modules[step.action.stage], DistributedDataParallel)
                             or is_fsdp_module(self.modules[step.action.stage]))}
        mesh.connect(self.lowered.pairs())
        self.transport = (PostedEarly if post_early else PointToPoint)(mesh, self.lowered)
        self.events: list[Event] = []

    def _placed(self, s: int, stage: nn.Module) -> nn.Module:
        """Stage ``s`` on this rank: on its device, split over the tensor-parallel ranks
        (with its messages in slices, see `parallel.boundaries`), replicated or sharded
        over the data-parallel ones."""
        mesh, schedule = self.mesh, self.schedule
        stage = stage.to(mesh.device)
        if mesh.tp > 1:
            stage = _tensor_parallel().tensor_parallel(shardable(stage), mesh.device_mesh["tp"],
                                                       self.sequence_parallel)
            if not self.sequence_parallel:   # else each rank sends its own positions
                elsewhere = lambda other: schedule.rank_of(other) != mesh.pipe_rank  # noqa: E731
                split_at_boundaries(stage, mesh.tp_group,
                                    gather_input=s > 0 and elsewhere(s - 1),
                                    slice_output=s < schedule.stages - 1 and elsewhere(s + 1))
        return self._replicated(stage)

    def _replicated(self, stage: nn.Module) -> nn.Module:
        mesh = self.mesh
        if mesh.dp == 1 or not any(p.requires_grad for p in stage.parameters()):
            return stage
        if self.shard_parameters:
            return _fsdp().shard_stage(stage, mesh.device_mesh["dp"], self.reshard_after_forward)
        if mesh.tp > 1:   # DDP refuses DTensor weights: its all-reduce on FSDP's machinery
            return _fsdp().replicate_stage(stage, mesh.device_mesh["dp"])
        cuda = mesh.device.type == "cuda"
        # Buffers are made equal once, at construction; syncing them on every forward
        # would be one more collective per micro-batch.
        return DistributedDataParallel(stage, device_ids=[mesh.device] if cuda else None,
                                       process_group=mesh.dp_group,
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
        if self.sequence_parallel:
            check_sequence_splits(inputs, self.mesh.tp)
        schedule, mesh = self.schedule, self.mesh
        step_seed, key = self._agree(inputs, target)
        micro_in, micro_target, weights = split_batch(inputs, target, schedule.microbatches,
                                                      mesh.dp, mesh.replica,
                                                      pin=mesh.device.type == "cuda")
        last = schedule.stages - 1
        if mesh.tp > 1:   # the logits are split over the vocabulary: see the docstring
            loss_fn = _vocabulary_parallel(loss_fn)
        runners = make_runners({s: (module, mesh.device) for s, module in self.modules.items()},
                               last, self.checkpoint, schedule.microbatches, step_seed,
                               loss_fn, weights, rng=owned_rng, inputs=inputs)

        def run() -> tuple[Tensor | None, float]:
            self.transport.start_step(key)
            stopwatch = Stopwatch(mesh.rank, mesh.device, mesh.clock)
            with contextlib.ExitStack() as around:   # DDP, FSDP: see the module docstring
                for module in self.modules.values():
                    if isinstance(module, DistributedDataParallel):
                        around.enter_context(module.no_sync())
                # a split backward's W needs the weights that I used: kept through the step
                sharded = [m for m in self.modules.values() if is_fsdp_module(m)]
                if sharded:
                    _fsdp().start_step(sharded, self.reshard_after_forward
                                       and not splits_backward(schedule))
                if mesh.tp > 1:   # (DTensor is loaded: the stages were split)
                    from torch.distributed.tensor.parallel import loss_parallel
                    around.enter_context(loss_parallel())
                run_program(self.program, runners, last, micro_in, micro_target,
                            self.transport, stopwatch, schedule.name, around=self._armed)
            self.transport.finish_step()   # names any message that did not come in time
            if mesh.tp > 1:
                _tensor_parallel().sum_partial_gradients(self.parameters())
            self.events = stopwatch.events()
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
        key = _layout_key(inputs, target, mesh.device)
        seed = new_step_seed() if mesh.rank == 0 else -1
        values = _fingerprint((inputs, target))   # where the batch is: no read, no copy
        head = transfer(torch.tensor([seed, key, -key, self.steps, -self.steps],
                                     dtype=torch.int64), values.device)
        sent = transfer(torch.cat([head, torch.stack([values, -values])]), mesh.device)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        step_seed, most_key, least_key, most_steps, least_steps, most, least = read_back(sent)
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
        """The block an action's backward runs in: for the stage's last backward of the
        step, DDP's all-reduce armed (see the module docstring), or FSDP's reduction
        after it; nothing for the others."""
        if self.sync_at.get(action.stage) != action:
            return contextlib.nullcontext()
        module = self.modules[action.stage]
        if is_fsdp_module(module):
            return _then(lambda: _fsdp().reduce_gradients(module))
        return self._all_reducing(action.stage)

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
        # each replica's count once: the ranks of a tensor-parallel group hold the same
        once = mesh.tp_rank == 0
        agreed = transfer(torch.tensor([(count or 0.0) * once, float(count is not None) * once],
                                       dtype=torch.float64), mesh.device)
        dist.all_reduce(agreed)   # [total count, replicas whose loss_fn returned counts]
        total, counted = read_back(agreed)
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


@contextlib.contextmanager
def _then(after: Callable[[], None]) -> Iterator[None]:
    """Run ``after`` once the block has finished without an error."""
    yield
    after()


def _fsdp() -> ModuleType:
    """`parallel.fsdp`, imported where a stage is sharded or replicated by FSDP's
    machinery: importing it (and DTensor with it) costs a second per process that most
    runs never need (see `pipeline_lib.sharded`)."""
    from pipeline_lib.parallel import fsdp
    return fsdp


def _tensor_parallel() -> ModuleType:
    """`parallel.tensor_parallel`, imported where tp > 1, as `_fsdp`."""
    from pipeline_lib.parallel import tensor_parallel
    return tensor_parallel


def _vocabulary_parallel(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` on logits split over the vocabulary (a `DTensor`; the step runs it
    under PyTorch's ``loss_parallel``), its loss (and count) as this rank's plain tensors:
    the same on every rank of the tensor-parallel group."""
    def loss(out: Any, target: Any) -> Any:
        return tree.map_tensors(lambda t: t.to_local() if is_dtensor(t) else t,
                                loss_fn(out, target))
    return loss


def check_data_layout(mesh: Mesh, sequence_parallel: bool, shard_parameters: bool,
                      reshard_after_forward: bool) -> None:
    """Refuse what the mesh cannot run, with what to change (`plan.Layout`'s rules)."""
    if sequence_parallel and mesh.tp == 1:
        raise ValueError("sequence_parallel splits the sequence over the tensor-parallel "
                         "ranks, so it needs a mesh with tp > 1 (init_mesh(..., tp=2))")
    if shard_parameters and mesh.dp == 1:
        raise ValueError("shard_parameters shards each stage's weights over the "
                         "data-parallel replicas, and this mesh has one (dp = 1): shard "
                         "over init_mesh(..., dp=2) or more, or leave shard_parameters off")
    if not reshard_after_forward and not shard_parameters:
        raise ValueError("reshard_after_forward=False keeps gathered weights between "
                         "forward and backward, which only sharded weights have: it needs "
                         "shard_parameters=True")


def check_sequence_splits(inputs: Any, tp: int) -> None:
    """Refuse inputs whose positions (dimension 1 of ``[batch, sequence, ...]``) do not
    split into ``tp`` equal shares, as sequence parallelism splits them (gloo's
    reduce-scatter of unequal shares aborts the process instead of raising)."""
    for leaf in tree.leaves(inputs):
        if isinstance(leaf, Tensor) and leaf.dim() >= 2 and leaf.size(1) % tp:
            raise ValueError(f"sequence parallelism gives each of the {tp} tensor-parallel "
                             f"ranks an equal share of the positions, but the inputs "
                             f"{list(leaf.shape)} have {leaf.size(1)} (dimension 1), which "
                             f"does not divide by {tp}: use sequences whose length does")


def check_runs_in_processes(module: nn.Sequential) -> None:
    """Refuse, before any rank talks to another, what only the threaded `Pipe` runs:
    `DeferredBatchNorm` and `WithDevice` layers. Each message names `Pipe` (the README's
    feature table lists what runs where)."""
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


def _layout_key(inputs: Any, target: Any, device: torch.device) -> int:
    """`p2p.batch_key` of what decides the layout of every message of a step: the
    batch's shapes and dtypes, which of its tensors every micro-batch gets whole
    (`NoChunk`), and autocast, which changes the dtypes stages compute in."""
    whole = [isinstance(leaf, NoChunk) for leaf in tree.leaves((inputs, target))]
    autocast = torch.is_autocast_enabled(device.type) and \
        torch.get_autocast_dtype(device.type)
    return batch_key(_shapes(inputs), _shapes(target), state=(whole, autocast))


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

