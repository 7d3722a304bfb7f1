"""`Pipe`: an `nn.Sequential` split into stages that run as a pipeline.

PyTorch removed `torch.distributed.pipeline.sync.Pipe` in 2.4; this is a readable
replacement with the same constructor, plus `step()`, which runs any `Schedule` with an
explicit backward per stage.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipeline_lib import tree
from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.checkpoint import check_mode
from pipeline_lib.devices import stage_devices
from pipeline_lib.executor import Stopwatch, perf_clock, run_program
from pipeline_lib.loss import StepGradients, check_grad_mode
from pipeline_lib.lowering import LoweredSchedule, lower, lower_forward
from pipeline_lib.microbatch import gather, split
from pipeline_lib.partition import group_layers
from pipeline_lib.rng import new_step_seed, streams_for
from pipeline_lib.schedules import BUILDERS, Schedule, plan
from pipeline_lib.skip import SkipKey, skip_routes
from pipeline_lib.stage import LossFn, StageRunner
from pipeline_lib.step import batch_loss, make_runners, split_batch, train_step
from pipeline_lib.thread_state import ThreadState
from pipeline_lib.threaded import allocator
from pipeline_lib.threaded.threads import InProcess, Mailbox, run_threads
from pipeline_lib.timeline import Timeline


_claims = threading.Condition()   # guards each Pipe's _stepping, _backwards and _held
LOWERINGS_KEPT = 8          # per Pipe: the schedules of the last steps, lowered


def _content(schedule: Any) -> Hashable:
    """What a step's lowering depends on in ``schedule``: its name, or a `Schedule`'s
    contents (a schedule changed in place since the last step is lowered again). One
    that cannot be hashed (not made of `Action`s) gets a key of its own: `plan` says
    what is wrong with it."""
    try:
        content = schedule if not isinstance(schedule, Schedule) else (
            schedule.name, schedule.ranks, schedule.microbatches, schedule.virtual_stages,
            schedule.placement, tuple(map(tuple, schedule.actions)))
        hash(content)
    except TypeError:
        return object()
    return content


def _training(stage: nn.Module) -> bool:
    """Whether any layer of ``stage`` is in training mode. Only layers without children
    are asked: the containers a Pipe makes to group layers into stages are not reached by
    ``model.eval()`` on the model it wraps."""
    return any(m.training for m in stage.modules() if next(m.children(), None) is None)


class Pipe(nn.Module):
    """Split ``module`` into stages and run micro-batches through them as a pipeline.

    * ``balance=None``: every top-level child of ``module`` is one stage; otherwise
      ``balance[k]`` consecutive layers form stage k.
    * ``devices``: one per stage (stages may share a device); by default, where each
      stage's parameters already are, or where a `WithDevice` layer in it says. Stages
      are moved to their devices.
    * ``chunks``: micro-batches per mini-batch (the classic API's name; everywhere else
      the library says ``microbatches``). Inputs are a tensor or a tuple, list or
      dict of them, nested; their tensors are split along dim 0; wrap a tensor in
      `NoChunk` to give it whole to every micro-batch (a shared mask). Stages may pass
      each other such trees too (see `microbatch`). ``checkpoint``: ``"always"``,
      ``"except_last"`` or ``"never"`` (see `pipeline_lib.checkpoint`); in eval mode,
      ``pipe(x)`` checkpoints nothing.
    * Skip connections: layers made with `skip.skippable` stash and pop tensors; each
      goes straight from the stashing stage's device to the popping stage's, and its
      gradient straight back. They are checked here: mismatches raise `SkipError`.
    * ``deferred_batch_norm=True``: BatchNorm layers become `DeferredBatchNorm`, whose
      running statistics are updated once per mini-batch, as without micro-batches.
      Without it they are updated once per micro-batch; checkpointing adds no update (a
      replay puts them back as it found them, see `pipeline_lib.checkpoint`).
    * Stage threads run under the caller's thread-local modes: ``torch.autocast``,
      saved-tensor hooks (``torch.autograd.graph.save_on_cpu``), grad and inference
      mode, the thread count (see `pipeline_lib.thread_state`).
    * Stages stay on their devices: moving the Pipe (``.cuda()``, ``.to(device)``)
      raises `TypeError`; a dtype conversion (``.double()``) is fine.
    * With a stage on the CPU, building a Pipe sets glibc's allocator, process-wide and
      once per process, to keep freed memory instead of faulting every step's
      activations in again (see `allocator`), which costs CPU stage threads part of
      their speedup. ``keep_freed_memory=False``, or
      ``PIPELINE_LIB_KEEP_FREED_MEMORY=0`` in the environment, leaves glibc's defaults.

    ``pipe(x)`` is the classic API: a pipelined forward whose output is connected to
    autograd, so ``criterion(pipe(x), y).backward()`` trains as usual; autograd runs the
    backward, calling each stage's. ``pipe.step(x, y, loss_fn, schedule)`` runs forward
    and backward under a schedule, one thread per device (the caller's own for a one-rank
    schedule), and records ``pipe.timeline``; ``loss_fn`` returns a mean or a
    ``SumCount(loss_sum, count)`` (see `pipeline_lib.loss`).
    Both leave no stage thread running when they fail or are interrupted.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1,
                 checkpoint: str = "except_last", balance: Sequence[int] | None = None,
                 devices: Sequence[torch.device | str] | None = None,
                 deferred_batch_norm: bool = False, keep_freed_memory: bool = True):
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"Pipe needs an nn.Sequential, got {type(module).__name__}; "
                            f"list the layers in order: nn.Sequential(layer0, layer1, ...)")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        if len(module) == 0:
            raise ValueError("cannot pipeline an empty nn.Sequential")
        self.chunks = chunks
        self.checkpoint = check_mode(checkpoint)
        if deferred_batch_norm:
            DeferredBatchNorm.convert(module, chunks)
        stages = group_layers(module, balance)
        stage_of_layer = [s for s, count in enumerate(balance or [1] * len(stages))
                          for _ in range(count)]
        self.skip_routes = skip_routes(module, stage_of_layer)
        self.devices = stage_devices(stages, devices)
        allocator.for_stages(self.devices, keep_freed_memory)
        self.partitions = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices))
        self.timeline: Timeline | None = None
        self._lowerings: dict[Hashable, LoweredSchedule] = {}   # see `_lowered`
        self._stepping = False   # a step is running (see `_one_step_at_a_time`)
        self._backwards = 0      # backwards of pipe(x) adding into .grad (`_outside_steps`)
        self._held: dict[Tensor, Tensor] = {}   # their gradients during a step, added after

    def __len__(self) -> int:
        return len(self.partitions)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling a Pipe saved before a step's bookkeeping grew: it starts empty."""
        super().__setstate__(state)
        for name, empty in (("_stepping", False), ("_backwards", 0), ("_held", {})):
            self.__dict__.setdefault(name, empty)

    def _apply(self, fn: Any, recurse: bool = True) -> Pipe:
        """Refuse to move a stage off its device: ``pipe.devices`` says where each stage
        runs and where its inputs are sent, so ``.cuda()``, ``.cpu()`` or ``.to(device)``
        would leave it wrong. Conversions that keep every tensor where it is
        (``.double()``, ``.to(torch.float16)``) pass. Every `nn.Module` move and
        conversion goes through ``_apply``; ``fn`` is tried on an empty tensor first."""
        for device in dict.fromkeys(getattr(self, "devices", [])):
            moved_to = fn(torch.empty(0, device=device)).device
            if moved_to != device:
                raise TypeError(f"cannot move a Pipe from {device} to {moved_to}: it places "
                                f"each stage on its own device (pipe.devices = "
                                f"{[str(d) for d in self.devices]}); build a new Pipe with "
                                f"devices=[...] instead, or move the model before wrapping it")
        return super()._apply(fn, recurse)

    # -- running programs: no half-finished state survives a failure -------------------

    def _run(self, lowered: LoweredSchedule, runners: Mapping[int, Any],
             inputs: list[Any], targets: list[Any]) -> None:
        """Each rank's lowered program on a thread of its own (`executor.run_program`),
        recording ``self.timeline``. If it fails (a stage raised, or the caller was
        interrupted), every stage thread has stopped when it returns, and
        `DeferredBatchNorm` layers forget the mini-batch's micro-batches they have seen."""
        programs, name = lowered.programs, lowered.schedule.name
        mailbox, last = Mailbox(), len(self.partitions) - 1
        devices = [self.devices[program[0].action.stage] for program in programs]
        clock = perf_clock()
        stopwatches = [Stopwatch(r, d, clock) for r, d in enumerate(devices)]

        def work(rank: int) -> None:
            transport = InProcess(mailbox, self.devices, rank, devices[rank])
            run_program(programs[rank], runners, last, inputs, targets, transport,
                        stopwatches[rank], name)
            stopwatches[rank].events()   # on CUDA: the device's work is done here

        try:
            run_threads(devices, work, mailbox)
        except BaseException:
            for layer in self.modules():
                if isinstance(layer, DeferredBatchNorm):
                    layer.forget_partial_batch()
            raise
        events = sorted((e for w in stopwatches for e in w.events()),
                        key=lambda e: (e.start, e.rank))
        self.timeline = Timeline(len(programs), events, unit="s", title=name)

    # -- the classic API: pipelined forward, autograd backward ---------------------------

    def forward(self, inputs: Any) -> Any:
        """The pipelined forward of ``inputs`` (a tensor, or a tuple, list or dict of them:
        see `microbatch.split`), connected to autograd.

        Each stage runs in a `StageRunner`, as in `step`; `_StageFunction` makes each
        (stage, micro-batch) forward a node of autograd's graph whose backward is the
        runner's, so checkpointed stages are replayed by the same code. The micro-batches'
        outputs are joined by `microbatch.gather`, which refuses what it cannot join
        (a 0-dim tensor, a number): reduce after ``pipe(x)`` instead.
        """
        micro = split(inputs, self.chunks)
        m, n = len(micro), len(self.partitions)
        if m > 1 and torch.is_grad_enabled() and run_by_data_parallel(self):
            raise RuntimeError(
                "this Pipe runs inside DistributedDataParallel with several micro-batches: "
                "each stage's backward accumulates a weight's gradient once per "
                "micro-batch, and DDP would all-reduce the first partial sum. For data "
                "parallelism across pipelines use DistributedPipe (a dp x pp mesh, DDP per "
                "stage); for the classic tutorial's DDP-wrapped Pipe use "
                "pipeline_lib.sync.Pipe, which runs the micro-batches in one graph there")
        step_seed = new_step_seed()
        modes = ThreadState.capture()   # a replay in the backward runs under its autocast
        # the caller's tensors are used as they are unless it wants their gradients
        wants_input_grads = any(t.requires_grad for t in tree.tensors(inputs))
        # In eval mode nothing is checkpointed (as in the classic API): evaluation rarely
        # runs a backward, so a checkpoint would only add a forward. The random streams are
        # `microbatch_rng`'s, the runners' default: a checkpointed stage replays its
        # forward in the caller's backward, on autograd's threads, beside whatever they run.
        runners = [StageRunner(s, self.partitions[s], self.devices[s],
                               self.checkpoint if _training(self.partitions[s]) else "never",
                               m, step_seed,
                               input_as_given=s == 0 and not wants_input_grads)
                   for s in range(n)]
        outputs: dict[int, Any] = {}
        stages = {s: _Autograd(runners[s], modes, outputs if s == n - 1 else None, self)
                  for s in range(n)}
        self._run(self._lowered(("forward", m), lambda: lower_forward(n, m, self.skip_routes)),
                  stages, micro, [None] * m)
        return gather([outputs[i] for i in range(m)])

    # -- scheduled training step ---------------------------------------------------------

    def _schedule(self, schedule: str | Schedule, microbatches: int) -> Schedule:
        n = len(self.partitions)
        if not isinstance(schedule, (str, Schedule)):
            raise TypeError(f"schedule must be the name of one ({', '.join(sorted(BUILDERS))})"
                            f" or a Schedule, got {schedule!r}")
        schedule = plan(schedule, None, n, microbatches)
        for s in range(n):
            first = schedule.stages_on(schedule.rank_of(s))[0]   # sets the rank's device
            if self.devices[s] != self.devices[first]:
                raise ValueError(f"{schedule.name} runs stage {s} on rank "
                                 f"{schedule.rank_of(s)}, so it must be on device "
                                 f"{self.devices[first]}, not {self.devices[s]}")
        return schedule

    def _lowered(self, key: Hashable, make: Callable[[], LoweredSchedule]) -> LoweredSchedule:
        """``make()`` (a lowering) made once per ``key``: a step lowers nothing that an
        earlier step with the same schedule and micro-batch count lowered."""
        lowered = self._lowerings.pop(key, None) or make()
        self._lowerings[key] = lowered   # the most recent last
        while len(self._lowerings) > LOWERINGS_KEPT:
            del self._lowerings[next(iter(self._lowerings))]
        return lowered

    @contextlib.contextmanager
    def _one_step_at_a_time(self) -> Iterator[None]:
        """Refuse a step while another runs on this Pipe (called from another thread).
        Each step sets ``.grad`` aside, lets its stages add into it and scales what they
        added (`StepGradients`): two at once would take each other's gradients aside and
        scale them, a silently wrong result. The flag, not a lock held over the step, so
        that a Pipe stays a plain object (``copy.deepcopy``, ``torch.save``). A backward
        of ``pipe(x)`` (from another thread, or from ``loss_fn``) is kept out of the
        step's gradients instead (`_outside_steps`): the step waits for those adding
        into ``.grad`` to end, and adds what those it held computed when it ends."""
        claimed = False
        try:
            with _claims:
                _claims.wait_for(lambda: not self._backwards)
                if self._stepping:
                    raise RuntimeError(
                        "Pipe.step was called while another step is running on this Pipe "
                        "(from another thread); two at once would mix their gradients in "
                        ".grad. A Pipe runs one step at a time: wait for the other to "
                        "return (e.g. hold a threading.Lock around your steps), or build a "
                        "second Pipe, on its own copy of the model, to train two at once")
                self._stepping = claimed = True
            yield
        finally:
            if claimed:
                with _claims:
                    self._stepping = False
                    held, self._held = self._held, {}
                self._add_to_grads(held)

    @contextlib.contextmanager
    def _outside_steps(self) -> Iterator[dict[Tensor, Tensor] | None]:
        """Where a stage backward of ``pipe(x)`` puts its weight gradients: None, into
        ``.grad``, when no step runs (a step starting meanwhile waits for it); else a
        dict, whose gradients are added to ``.grad`` once the step has ended, so that
        the step does not scale them as its own. Nothing here waits for a step: on a
        GPU, autograd runs this backward on the device's one thread, which the step's
        own backwards need too."""
        with _claims:
            held = {} if self._stepping else None
            if held is None:
                self._backwards += 1
        try:
            yield held
        finally:
            if held is None:
                with _claims:
                    self._backwards -= 1
                    _claims.notify_all()
            else:
                with _claims:
                    if self._stepping:
                        for p, g in held.items():
                            self._held[p] = self._held[p] + g if p in self._held else g
                        held = {}
                self._add_to_grads(held)

    def _add_to_grads(self, grads: dict[Tensor, Tensor]) -> None:
        """Accumulate ``grads`` into ``.grad`` as autograd does (it holds each
        parameter's lock), counted as a backward into ``.grad``: a step waits for it."""
        if not grads:
            return
        with _claims:
            self._backwards += 1
        try:
            torch.autograd.backward(list(grads), list(grads.values()))
        finally:
            with _claims:
                self._backwards -= 1
                _claims.notify_all()

    def step(self, inputs: Any, target: Any, loss_fn: LossFn,
             schedule: str | Schedule = "gpipe") -> Tensor:
        """One forward and backward of a mini-batch under ``schedule``.

        ``inputs`` and ``target`` are tensors or trees of them (see `microbatch.split`)
        with the same number of rows. ``loss_fn(output, target)`` returns either a
        mean-reduced scalar or a ``SumCount(loss_sum, count)`` (see `pipeline_lib.loss`);
        parameter gradients accumulate as ``loss.backward()`` of the whole batch's loss
        would add them (mean, or Σ loss_sum / Σ count), and that loss is returned,
        detached; an input tensor that requires grad gets the loss's gradient too (and
        what it was computed from). If the step fails or is interrupted, ``.grad`` is
        left as it was, and every stage thread has stopped when it raises; an interrupt
        that comes while the step commits its gradients is raised once they are in: the
        step then counts.
        One step at a time per Pipe: a second call while one runs (from another thread)
        raises `RuntimeError`.
        """
        with self._one_step_at_a_time():
            return self._step(inputs, target, loss_fn, schedule)

    def _step(self, inputs: Any, target: Any, loss_fn: LossFn,
              schedule: str | Schedule) -> Tensor:
        check_grad_mode("Pipe.step")
        micro_in, micro_target, weights = split_batch(
            inputs, target, self.chunks, pin=any(d.type == "cuda" for d in self.devices))
        m, n = len(micro_in), len(self.partitions)
        lowered = self._lowered(
            ("step", _content(schedule), m),
            lambda: lower(self._schedule(schedule, m), self.skip_routes))
        runners = make_runners({s: (self.partitions[s], self.devices[s]) for s in range(n)},
                               n - 1, self.checkpoint, m, new_step_seed(), loss_fn,
                               weights, rng=streams_for(lowered.ranks), inputs=inputs)

        def run() -> tuple[Tensor, float]:
            self._run(lowered, runners, micro_in, micro_target)
            loss, scale = batch_loss([runners[n - 1].losses[i] for i in range(m)])
            runners[0].backward_into_caller(scale)
            return loss, scale

        return train_step(self.parameters(), run, StepGradients)


class _Autograd:
    """A `StageRunner` whose forward is a node of autograd's graph (`_StageFunction`),
    for ``pipe(x)``: `run_program` drives it like the runner itself. The last stage's
    keeps its outputs in ``outputs``, for `gather`."""

    def __init__(self, runner: StageRunner, modes: ThreadState,
                 outputs: dict[int, Any] | None, pipe: Pipe):
        self.runner, self.device, self.modes, self.outputs = runner, runner.device, modes, outputs
        self.pipe = pipe
        self.stashed: dict[int, dict[SkipKey, Tensor]] = {}

    def forward(self, microbatch: int, x: Any, target: Any = None,
                skips: Mapping[SkipKey, Tensor] | None = None) -> Any:
        y, self.stashed[microbatch] = _StageFunction.run(self.runner, microbatch, x,
                                                         dict(skips or {}), self.modes,
                                                         self.pipe)
        if self.outputs is not None:
            self.outputs[microbatch] = y
        return y

    def take_stashed(self, microbatch: int) -> dict[SkipKey, Tensor]:
        return self.stashed.pop(microbatch)


class _StageFunction(torch.autograd.Function):
    """One stage's forward of one micro-batch as a node of autograd's graph, for
    ``pipe(x)``: its inputs are the stage's input tensors (and the skip tensors it pops),
    its outputs the stage's output tensors (and the skip tensors it stashes), and its
    backward is the `StageRunner`'s, which replays a checkpointed forward first."""

    @staticmethod
    def run(runner: StageRunner, microbatch: int, x: Any, skips: dict[SkipKey, Tensor],
            modes: ThreadState, pipe: Pipe) -> tuple[Any, dict[SkipKey, Tensor]]:
        """The stage's output and stashed tensors, connected to autograd if it is on.
        ``modes``: the caller's, whose autocast a checkpointed forward is replayed under
        (autograd calls the backward on any thread, outside the caller's block); the
        backward keeps its weight gradients out of a running step of ``pipe``."""
        y = runner.forward(microbatch, x, skips=skips)
        stashed = runner.take_stashed(microbatch)
        if not torch.is_grad_enabled():
            return y, stashed
        # autograd must call the backward whenever the stage has weights to train, even
        # if no input needs a gradient (stage 0): a 0-element input that needs one
        trainable = any(p.requires_grad for p in runner.module.parameters())
        trains = torch.empty(0, device=runner.device, requires_grad=trainable)
        # a skip may carry None (stash(name, None)): only tensors enter the graph
        stashed_tensors = {k: t for k, t in stashed.items() if isinstance(t, Tensor)}
        popped = [k for k, t in skips.items() if isinstance(t, Tensor)]
        flat = iter(_StageFunction.apply(runner, microbatch, x, y, stashed_tensors, popped,
                                         (modes, pipe), trains, *tree.tensors(x),
                                         *(skips[k] for k in popped)))
        y = tree.map_tensors(lambda _: next(flat), y)
        return y, {k: next(flat) if k in stashed_tensors else t for k, t in stashed.items()}

    @staticmethod
    def forward(ctx, runner: StageRunner, microbatch: int, x: Any, y: Any,
                stashed: dict[SkipKey, Tensor], popped: list[SkipKey],
                context: tuple[ThreadState, Pipe], trains: Tensor,
                *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.runner, ctx.microbatch, ctx.y, ctx.stash_keys = runner, microbatch, y, list(stashed)
        ctx.popped, (ctx.modes, ctx.pipe) = popped, context
        ctx.x_is_tensor = [isinstance(leaf, Tensor) for leaf in tree.leaves(x)]
        ctx.set_materialize_grads(False)   # None, not zeros, for outputs left unused
        outputs = [t.detach() for t in tree.tensors(y) + list(stashed.values())]
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        n = len(grads) - len(ctx.stash_keys)
        it = iter(grads[:n])
        grad_y = tree.map_leaves(lambda v: next(it) if isinstance(v, Tensor) else None, ctx.y)
        runner, i = ctx.runner, ctx.microbatch
        # autograd runs backwards with grad mode off; a replay needs it on
        with ctx.pipe._outside_steps() as held, torch.enable_grad(), \
                ctx.modes.autocast_applied():
            grad_x = runner.backward(i, grad_y, into=held,
                                     skip_grads=dict(zip(ctx.stash_keys, grads[n:])))
        popped = runner.take_skip_grads(i)
        grad_x = [g for g, is_tensor in zip(tree.leaves(grad_x), ctx.x_is_tensor) if is_tensor] \
            if grad_x is not None else [None] * sum(ctx.x_is_tensor)
        return (None,) * 8 + (*grad_x, *(popped.get(k) for k in ctx.popped))


def run_by_data_parallel(pipe: nn.Module) -> bool:
    """Whether `DistributedDataParallel` is running ``pipe``'s forward (PyTorch keeps the
    DDP module whose forward is running; there is no public way to ask)."""
    from torch.nn.parallel import DistributedDataParallel

    active = DistributedDataParallel._get_active_ddp_module()
    return active is not None and active.module is pipe

