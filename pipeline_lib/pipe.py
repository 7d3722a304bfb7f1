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

from .checkpoint import check_mode, checkpointed, checkpointing, recomputing
from .devices import module_device, transfer
from .microbatch import gather, loss_weights, split
from .rng import microbatch_rng, new_step_seed, seed_for
from .schedules import Action, Schedule, build, validate
from .stage import LossFn, StageRunner
from .threaded import Mailbox, run_programs
from .timeline import Timeline


def _partition(module: nn.Sequential, balance: Sequence[int] | None) -> list[nn.Module]:
    layers = list(module.children())
    if balance is None:
        return layers
    balance = list(balance)
    if any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance must be positive layer counts, got {balance}")
    if sum(balance) != len(layers):
        raise ValueError(f"balance {balance} sums to {sum(balance)} but the module has "
                         f"{len(layers)} layers; the counts must add up to the number of "
                         f"layers (see pipeline_lib.partition to compute one)")
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(*layers[start:start + count]))
        start += count
    return stages


class Pipe(nn.Module):
    """Split ``module`` into stages and run micro-batches through them as a pipeline.

    * ``balance=None``: every top-level child of ``module`` is one stage; otherwise
      ``balance[k]`` consecutive layers form stage k.
    * ``devices``: one per stage (stages may share a device); by default, where each
      stage's parameters already are. Stages are moved to their devices.
    * ``chunks``: micro-batches per mini-batch. ``checkpoint``: ``"always"``,
      ``"except_last"`` or ``"never"`` (see `pipeline_lib.checkpoint`).

    ``pipe(x)`` is the classic API: a pipelined forward whose output is connected to
    autograd, so ``criterion(pipe(x), y).backward()`` trains as usual; its backward is
    autograd's own. ``pipe.step(x, y, loss_fn, schedule)`` runs forward and backward
    under a schedule, one thread per device, and records ``pipe.timeline``.
    """

    def __init__(self, module: nn.Sequential, chunks: int = 1,
                 checkpoint: str = "except_last", balance: Sequence[int] | None = None,
                 devices: Sequence[torch.device | str] | None = None):
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
        stages = _partition(module, balance)
        if devices is None:
            found, previous = [], torch.device("cpu")
            for stage in stages:
                previous = module_device(stage, previous)
                found.append(previous)
            devices = found
        if len(devices) != len(stages):
            raise ValueError(f"got {len(devices)} devices for {len(stages)} stages; give "
                             f"one device per stage (stages may share a device)")
        self.devices = [torch.device(d) for d in devices]
        self.partitions = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices))
        self.timeline: Timeline | None = None

    def __len__(self) -> int:
        return len(self.partitions)

    # -- the classic API: pipelined forward, autograd backward ---------------------------

    def _stage_forward(self, stage: int, microbatch: int, microbatches: int,
                       step_seed: int, x: Any) -> Any:
        seed = seed_for(step_seed, stage, microbatch)
        device = self.devices[stage]

        def run(inputs: Any) -> Any:
            with microbatch_rng(seed, device):
                return self.partitions[stage](inputs)

        if not (torch.is_grad_enabled()
                and checkpointed(self.checkpoint, microbatch, microbatches)):
            return run(x)
        calls = []

        def run_checkpointed(inputs: Any) -> Any:
            calls.append(None)
            with (recomputing() if len(calls) > 1 else checkpointing()):
                return run(inputs)

        return torch.utils.checkpoint.checkpoint(run_checkpointed, x, use_reentrant=False,
                                                 preserve_rng_state=False)

    def forward(self, inputs: Any) -> Any:
        micro = split(inputs, self.chunks)
        m, n = len(micro), len(self.partitions)
        step_seed = new_step_seed()
        outputs: dict[int, Any] = {}
        mailbox = Mailbox()

        def receive(action: Action) -> Any:
            s, i = action.stage, action.microbatch
            return micro[i] if s == 0 else mailbox.get((s, i))

        def compute(action: Action, x: Any) -> None:
            s, i = action.stage, action.microbatch
            y = self._stage_forward(s, i, m, step_seed, transfer(x, self.devices[s]))
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
        if isinstance(schedule, str):
            if schedule == "interleaved_1f1b":
                if n % 2:
                    raise ValueError(f"interleaved_1f1b puts 2 stages on each device, so "
                                     f"it needs an even number of stages, not {n}")
                schedule = build(schedule, n // 2, microbatches, virtual_stages=2)
            else:
                schedule = build(schedule, n, microbatches)
        if schedule.stages != n or schedule.microbatches != microbatches:
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.stages} stages "
                             f"and {schedule.microbatches} micro-batches, but this Pipe has "
                             f"{n} stages and the batch was split into {microbatches}")
        validate(schedule)
        for s in range(n):
            if self.devices[s] != self.devices[schedule.rank_of(s)]:
                raise ValueError(f"{schedule.name} runs stage {s} on rank "
                                 f"{schedule.rank_of(s)}, so it must be on device "
                                 f"{self.devices[schedule.rank_of(s)]}, not {self.devices[s]}")
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
        weights = loss_weights(micro_in)
        runners = [StageRunner(s, self.partitions[s], self.devices[s], self.checkpoint, m,
                               step_seed, loss_fn=loss_fn if s == n - 1 else None,
                               loss_weights=weights, first=s == 0) for s in range(n)]
        mailbox = Mailbox()

        def receive(action: Action) -> Any:
            """The activation (F) or output gradient (B, I) this action consumes."""
            s, i = action.stage, action.microbatch
            if action.kind == "F":
                return micro_in[i] if s == 0 else mailbox.get(("F", s, i))
            if action.kind in ("B", "I") and s < n - 1:
                return mailbox.get(("B", s, i))
            return None

        def compute(action: Action, received: Any) -> None:
            s, i = action.stage, action.microbatch
            runner, device = runners[s], self.devices[s]
            if action.kind == "F":
                target_i = transfer(micro_target[i], device) if s == n - 1 else None
                y = runner.forward(i, transfer(received, device), target_i)
                if s < n - 1:
                    mailbox.put(("F", s + 1, i), transfer(y, self.devices[s + 1]))
            elif action.kind == "W":
                runner.backward_weight(i)
            else:
                backward = runner.backward if action.kind == "B" else runner.backward_input
                grad_in = backward(i, received)
                if s > 0:
                    mailbox.put(("B", s - 1, i), transfer(grad_in, self.devices[s - 1]))

        rank_devices = [self.devices[r] for r in range(plan.ranks)]
        self.timeline = run_programs(plan.actions, rank_devices, receive, compute, mailbox,
                                     plan.name)
        losses = runners[-1].losses
        return torch.stack([losses[i] for i in range(m)]).sum()
