"""`Pipe`: an `nn.Sequential` split into stages that run as a pipeline.

PyTorch removed `torch.distributed.pipeline.sync.Pipe` in 2.4; this is a readable
replacement with the same constructor, plus `step()`, which runs any `Schedule` with an
explicit backward per stage.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from pipeline_lib.batchnorm import DeferredBatchNorm
from pipeline_lib.checkpoint import check_mode, checkpointed, checkpointing, recomputing
from pipeline_lib.devices import stage_devices, transfer
from pipeline_lib.microbatch import gather, loss_weights, split
from pipeline_lib.partition import group_layers
from pipeline_lib.rng import microbatch_rng, new_step_seed, seed_for
from pipeline_lib.schedules import Action, Schedule, plan, ranks_for
from pipeline_lib.skip import SkipError, SkipKey, SkipTracker, describe, skip_routes, use_tracker
from pipeline_lib.stage import LossFn, StageRunner
from pipeline_lib.threaded.threads import Mailbox, run_programs
from pipeline_lib.timeline import Timeline


class Pipe(nn.Module):
    """Split ``module`` into stages and run micro-batches through them as a pipeline.

    * ``balance=None``: every top-level child of ``module`` is one stage; otherwise
      ``balance[k]`` consecutive layers form stage k.
    * ``devices``: one per stage (stages may share a device); by default, where each
      stage's parameters already are, or where a `WithDevice` layer in it says. Stages
      are moved to their devices.
    * ``chunks``: micro-batches per mini-batch. Inputs are split along dim 0; wrap a
      tensor in `NoChunk` to give it whole to every micro-batch (a shared mask).
      ``checkpoint``: ``"always"``, ``"except_last"`` or ``"never"`` (see
      `pipeline_lib.checkpoint`).
    * Skip connections: layers made with `skip.skippable` stash and pop tensors; each
      goes straight from the stashing stage's device to the popping stage's, and its
      gradient straight back. They are checked here: mismatches raise `SkipError`.
    * ``deferred_batch_norm=True``: BatchNorm layers become `DeferredBatchNorm`, whose
      running statistics are updated once per mini-batch, as without micro-batches.

    ``pipe(x)`` is the classic API: a pipelined forward whose output is connected to
    autograd, so ``criterion(pipe(x), y).backward()`` trains as usual; its backward is
    autograd's own. ``pipe.step(x, y, loss_fn, schedule)`` runs forward and backward
    under a schedule, one thread per device, and records ``pipe.timeline``.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1,
                 checkpoint: str = "except_last", balance: Sequence[int] | None = None,
                 devices: Sequence[torch.device | str] | None = None,
                 deferred_batch_norm: bool = False):
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
        self.partitions = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices))
        self.timeline: Timeline | None = None

    def __len__(self) -> int:
        return len(self.partitions)

    # -- the classic API: pipelined forward, autograd backward ---------------------------

    def _stage_forward(self, stage: int, microbatch: int, microbatches: int,
                       step_seed: int, x: Any, skips: dict[SkipKey, Tensor]
                       ) -> tuple[Any, dict[SkipKey, Tensor]]:
        """The stage's output and the tensors it stashed for later stages, both connected
        to autograd (a checkpointed stage's recomputation pops ``skips`` again and its
        stashes are dropped: the first run's are the ones in the graph)."""
        seed = seed_for(step_seed, stage, microbatch)
        device = self.devices[stage]
        trackers: list[SkipTracker] = []

        def run(inputs: Any) -> Any:
            trackers.append(SkipTracker(skips))
            with microbatch_rng(seed, device), use_tracker(trackers[-1]):
                return self.partitions[stage](inputs)

        if not (torch.is_grad_enabled()
                and checkpointed(self.checkpoint, microbatch, microbatches)):
            return run(x), trackers[0].stashed

        def run_checkpointed(inputs: Any) -> Any:
            with (recomputing() if trackers else checkpointing()):
                return run(inputs)

        y = torch.utils.checkpoint.checkpoint(run_checkpointed, x, use_reentrant=False,
                                              preserve_rng_state=False)
        return y, trackers[0].stashed

    # -- skip connections: straight from the stashing stage to the popping stage ---------

    def _send_skips(self, mailbox: Mailbox, stage: int, microbatch: int,
                    stashed: dict[SkipKey, Tensor]) -> None:
        for route in self.skip_routes:
            if route.source != stage:
                continue
            if route.key not in stashed:
                raise SkipError(f"stage {stage} declares a stash of {describe(route.key)} "
                                f"but its forward of micro-batch {microbatch} did not stash "
                                f"it; stage {route.target} would wait for it forever")
            mailbox.put(("skip", route.key, microbatch),
                        transfer(stashed[route.key], self.devices[route.target]))

    def _receive_skips(self, mailbox: Mailbox, stage: int, microbatch: int
                       ) -> dict[SkipKey, Tensor]:
        return {route.key: mailbox.get(("skip", route.key, microbatch))
                for route in self.skip_routes if route.target == stage}

    def _send_skip_grads(self, mailbox: Mailbox, microbatch: int,
                         grads: dict[SkipKey, Tensor | None]) -> None:
        for route in self.skip_routes:
            if route.key in grads:
                mailbox.put(("skip-grad", route.key, microbatch),
                            transfer(grads[route.key], self.devices[route.source]))

    def _receive_skip_grads(self, mailbox: Mailbox, stage: int, microbatch: int
                            ) -> dict[SkipKey, Tensor | None]:
        return {route.key: mailbox.get(("skip-grad", route.key, microbatch))
                for route in self.skip_routes if route.source == stage}

    def forward(self, inputs: Any) -> Any:
        micro = split(inputs, self.chunks)
        m, n = len(micro), len(self.partitions)
        step_seed = new_step_seed()
        outputs: dict[int, Any] = {}
        mailbox = Mailbox()

        def receive(action: Action) -> tuple[Any, dict[SkipKey, Tensor]]:
            s, i = action.stage, action.microbatch
            x = micro[i] if s == 0 else mailbox.get((s, i))
            return x, self._receive_skips(mailbox, s, i)

        def compute(action: Action, received: tuple[Any, dict[SkipKey, Tensor]]) -> None:
            s, i = action.stage, action.microbatch
            x, skips = received
            y, stashed = self._stage_forward(s, i, m, step_seed,
                                             transfer(x, self.devices[s]), skips)
            self._send_skips(mailbox, s, i, stashed)
            if s == n - 1:
                outputs[i] = y
            else:
                mailbox.put((s + 1, i), transfer(y, self.devices[s + 1]))

        programs = [[Action(s, "F", i) for i in range(m)] for s in range(n)]
        self.timeline = run_programs(programs, self.devices, receive, compute, mailbox,
                                     "forward")
        return gather([outputs[i] for i in range(m)])

    # -- scheduled training step ---------------------------------------------------------

    def _schedule(self, schedule: str | Schedule, microbatches: int) -> Schedule:
        n = len(self.partitions)
        ranks = schedule.ranks if isinstance(schedule, Schedule) else ranks_for(schedule, n)
        schedule = plan(schedule, ranks, n, microbatches)
        for s in range(n):
            first = schedule.stages_on(schedule.rank_of(s))[0]   # sets the rank's device
            if self.devices[s] != self.devices[first]:
                raise ValueError(f"{schedule.name} runs stage {s} on rank "
                                 f"{schedule.rank_of(s)}, so it must be on device "
                                 f"{self.devices[first]}, not {self.devices[s]}")
        return schedule

    def step(self, inputs: Any, target: Any, loss_fn: LossFn,
             schedule: str | Schedule = "gpipe") -> Tensor:
        """One forward and backward of a mini-batch under ``schedule``.

        Parameter gradients accumulate as ``loss_fn(module(inputs), target).backward()``
        would, for a loss that averages over the batch (`microbatch.loss_weights` holds
        the scaling rule). Returns that loss, detached.
        """
        micro_in = split(inputs, self.chunks)
        micro_target = split(target, self.chunks)
        if len(micro_target) != len(micro_in):
            raise ValueError("inputs and target must have the same batch size")
        m, n = len(micro_in), len(self.partitions)
        plan = self._schedule(schedule, m)
        step_seed = new_step_seed()
        weights = loss_weights(micro_target)   # the loss averages over target rows
        runners = [StageRunner(s, self.partitions[s], self.devices[s], self.checkpoint, m,
                               step_seed, loss_fn=loss_fn if s == n - 1 else None,
                               loss_weights=weights, first=s == 0) for s in range(n)]
        mailbox = Mailbox()

        def receive(action: Action) -> tuple[Any, dict[SkipKey, Tensor | None]] | None:
            """The activation (F) or output gradient (B, I) this action consumes, with the
            skip tensors it pops (F) or the gradients of those it stashed (B, I)."""
            s, i = action.stage, action.microbatch
            if action.kind == "F":
                x = micro_in[i] if s == 0 else mailbox.get(("F", s, i))
                return x, self._receive_skips(mailbox, s, i)
            if action.kind in ("B", "I"):
                grad = mailbox.get(("B", s, i)) if s < n - 1 else None
                return grad, self._receive_skip_grads(mailbox, s, i)
            return None

        def compute(action: Action, received: Any) -> None:
            s, i = action.stage, action.microbatch
            runner, device = runners[s], self.devices[s]
            if action.kind == "F":
                x, skips = received
                target_i = transfer(micro_target[i], device) if s == n - 1 else None
                y = runner.forward(i, transfer(x, device), target_i, skips=skips)
                self._send_skips(mailbox, s, i, runner.take_stashed(i))
                if s < n - 1:
                    mailbox.put(("F", s + 1, i), transfer(y, self.devices[s + 1]))
            elif action.kind == "W":
                runner.backward_weight(i)
            else:
                grad, skip_grads = received
                backward = runner.backward if action.kind == "B" else runner.backward_input
                grad_in = backward(i, grad, skip_grads=skip_grads)
                self._send_skip_grads(mailbox, i, runner.take_skip_grads(i))
                if s > 0:
                    mailbox.put(("B", s - 1, i), transfer(grad_in, self.devices[s - 1]))

        rank_devices = [self.devices[plan.stages_on(r)[0]] for r in range(plan.ranks)]
        self.timeline = run_programs(plan.actions, rank_devices, receive, compute, mailbox,
                                     plan.name)
        losses = runners[-1].losses
        return torch.stack([losses[i] for i in range(m)]).sum()
