"""Checkpoints of a multi-process pipelined run that outlive its layout.

A checkpoint is keyed by the *unpipelined* model's names (``"3.attn.in_proj_weight"``, the
keys of ``transformer_lm(...).state_dict()``), never by stage or rank: so the run can go on
with another ``pp``, ``dp``, balance or schedule, and `merged_state_dict` is the plain
model's state dict. On disk::

    DIR/latest                      the name of the newest complete step folder
    DIR/step-000100/stage-3.pt      stage 3's weights and its parameters' optimizer state
    DIR/step-000100/run.pt          the step, the random state, the optimizer's class
    DIR/.lock                       held by the run saving here (`claimed`), if any

Each stage's file is written by replica 0's rank holding it (the replicas hold equal
copies), through a temporary file and ``os.replace``; ``latest`` moves to the new folder
only after every rank has written, so a run killed mid-save resumes from the last
complete checkpoint, never from a mix of two steps. What a killed save left (temporary
files, a step folder ``latest`` never named) goes at the next save.

A checkpoint is never replaced by one that cannot be trained on: a save whose weights or
optimizer state hold a NaN or an infinity (a run that diverged) is refused on every rank,
and ``latest`` keeps naming the last good one. So is an optimizer holding parameters that
are not the pipe's: their values and state would not be saved.

The optimizer keeps the settings the resuming run gave it (learning rate, weight decay,
per group, per rank: ranks may build their groups differently); the checkpoint restores
each parameter's state (Adam's moments and step count). `torch.optim.Optimizer`'s own
``load_state_dict`` restores the saved settings too, but those are per group, and the
groups of a rank depend on the layout, which a resume may change; and a learning rate
is usually set by the run's schedule, step by step, anyway.

Resuming continues *exactly* (same losses, bit for bit) when the arithmetic of a step does
not depend on the layout: the same replica count (``dp``), micro-batches per replica and no
dropout; the pipeline size and balance may change. Dropout masks are drawn per (stage,
micro-batch) (`pipeline_lib.rng`), so they follow the layout: with dropout, a resume is
exact on the same layout only. A changed ``dp`` averages the replicas' gradients in
another order: equal within float rounding.

Three dimensions: stages split over ``tp`` ranks (`pipeline_lib.parallel`) or sharded
over the replicas (FSDP) hold `DTensor` parts of each weight and of its optimizer state.
Every rank of a stage's group gathers them whole (collectives, in one order on all of
them), and the group's first rank writes them, under the unpipelined model's names: a
`ShardableBlock`'s query, key and value projections joined into ``nn.MultiheadAttention``'s
``in_proj_weight`` (`parallel.block.pack_projections`), their Adam moments alike. On
resume each rank cuts its own part out of the whole tensors (`distribute_tensor` without
communication), so ``tp``, ``pp`` and ``dp`` may all change, and FSDP come or go.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import numbers
import os
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pipeline_lib.distributed.pipe import DistributedPipe
from pipeline_lib.parallel.block import pack_projections, packed_name, unpack_projections
from pipeline_lib.sharded import is_dtensor

T = TypeVar("T")
LATEST = "latest"
RUN = "run.pt"
LOCK = ".lock"
PART = ".part"   # the end of a file being written
_STEP_FOLDER = re.compile(r"step-\d{6,}")


def _stage_file(stage: int) -> str:
    return f"stage-{stage}.pt"


def full_names(pipe: DistributedPipe, balance: Sequence[int]) -> dict[int, dict[str, str]]:
    """Per stage this rank holds, its state-dict keys -> the unpipelined model's: stage
    ``s`` holds layers ``sum(balance[:s])`` onwards, its own layer ``j`` being the
    model's layer ``sum(balance[:s]) + j``. ``balance`` must be the one the pipe was
    built with, or the names would be other layers' (checked on this rank's stages)."""
    held = {s: len(_unwrapped(module)) for s, module in pipe.modules.items()}
    if len(balance) != pipe.schedule.stages or any(balance[s] != n for s, n in held.items()):
        raise ValueError(f"balance {list(balance)} is not the one this pipe was built with "
                         f"({pipe.schedule.stages} stages; here stage(s) "
                         f"{', '.join(f'{s} hold(s) {n} layer(s)' for s, n in held.items())}): "
                         f"pass DistributedPipe's own balance, which names each stage's layers")
    starts = list(itertools.accumulate(balance, initial=0))
    names = {}
    for s, module in pipe.modules.items():
        keys = pack_projections(_tensors(_unwrapped(module)), lambda parts: parts[0])
        names[s] = {key: _shifted(key, starts[s]) for key in keys}
    return names


def _shifted(key: str, start: int) -> str:
    layer, _, rest = key.partition(".")
    return f"{start + int(layer)}.{rest}"


def _unwrapped(module: nn.Module) -> nn.Module:
    """A stage as its layers: DDP's wrapper taken off (FSDP's units are the modules)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """What a stage's state dict holds, by parameter name (a `ShardableBlock`'s three
    projections apart): its parameters and persistent buffers, without calling
    ``state_dict()``, which gathers the parts of a tensor-parallel block."""
    found = dict(module.named_parameters())
    for owner_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                found[f"{owner_name}.{name}" if owner_name else name] = buffer
    return found


def _is_split(pipe: DistributedPipe) -> bool:
    """Whether this rank's stages hold parts of tensors (`DTensor`s: tensor
    parallelism, FSDP), which every rank of a stage's group gathers together."""
    return any(is_dtensor(p) for p in pipe.parameters())


def _whole(t: Tensor) -> Tensor:
    """A tensor as one process holds it, on the CPU (a `DTensor` gathered: collective)."""
    t = t.detach()
    return (t.full_tensor() if is_dtensor(t) else t).cpu()


def _joined(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state of three projections joined as their packed parameter: each
    parameter-shaped tensor concatenated; a step count (a number, or a tensor of one
    element) as it is, the same for all three."""
    return {key: torch.cat([s[key] for s in states])
            if isinstance(value, Tensor) and value.dim() else value
            for key, value in states[0].items()}


def _split(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The inverse of `_joined`: each projection its own copies (Adam counts a step
    tensor up in place: one shared by three parameters would count three steps)."""
    return [{key: (value.chunk(3)[k] if value.dim() else value).clone()
             if isinstance(value, Tensor) else value
             for key, value in state.items()} for k in range(3)]


def _write_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` into a temporary file beside ``path``, then renamed over it
    (`_atomically`), through a Python file, so that a full disk is the OSError it is
    (given a path, torch.save says "enforce fail at inline_container.cc ... unexpected
    pos")."""
    _atomically(path, lambda file: torch.save(obj, file))


def _atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write`` a temporary file beside ``path``, then rename it over ``path``: a kill or
    a full disk mid-write leaves the file as it was. A full disk is named, with the file
    and the space left."""
    partial = path.with_name(f".{path.name}.{os.getpid()}{PART}")
    try:
        with partial.open("wb") as file:
            write(file)
        os.replace(partial, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(path.parent).free
        raise OSError(exc.errno, f"no space left to save {path} (the disk is full or "
                      f"over quota: {free / 2**20:,.0f} MiB free there); free some space or "
                      f"save into a folder on another disk. The last complete checkpoint "
                      f"(the one `latest` names) is unchanged") from exc
    finally:
        partial.unlink(missing_ok=True)


def _param_places(pipe: DistributedPipe) -> dict[int, tuple[int, str]]:
    """id(parameter) -> (its stage, its name there), for this rank's parameters."""
    return {id(p): (s, local) for s, module in pipe.modules.items()
            for local, p in _unwrapped(module).named_parameters()}


def save(folder: str | Path, step: int, pipe: DistributedPipe, balance: Sequence[int],
         optimizer: torch.optim.Optimizer) -> Path:
    """Save the run after ``step`` optimizer steps into ``folder``; every rank must call it.
    Returns the step's folder."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be the number of optimizer steps run, a whole number "
                         f">= 0, not {step!r}")
    folder = Path(folder)
    target = folder / f"step-{step:06d}"
    mesh = pipe.mesh
    names = full_names(pipe, balance)
    outside = _outside_the_pipe(pipe, optimizer, "saved")
    writes = mesh.replica == 0 and mesh.tp_rank == 0   # the others hold copies or parts
    _agree_everywhere(pipe, outside)
    # parts of tensors are gathered by every rank of the stage's group
    parts = {s: _stage_part(pipe, names[s], s, optimizer) for s in pipe.modules} \
        if writes or _is_split(pipe) else {}
    _agree_everywhere(pipe, _nonfinite(parts, step, folder) if writes else None)
    if mesh.rank == 0:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            blocker = next(p for p in [target, *target.parents] if p.exists())
            raise NotADirectoryError(f"cannot save into {folder}: {blocker} is a file, not "
                                     f"a folder; give a folder's path (a new one is "
                                     f"created)") from None
    dist.barrier()
    for s in pipe.modules if writes else ():
        _write_atomically(parts[s], target / _stage_file(s))
    if mesh.rank == 0:
        _write_atomically({"step": step, "rng": torch.get_rng_state(),
                           "stages": pipe.schedule.stages,
                           "optimizer": type(optimizer).__name__}, target / RUN)
    dist.barrier()   # every stage written: only now may `latest` point here
    if mesh.rank == 0:
        _atomically(folder / LATEST, lambda file: file.write(target.name.encode()))
        for old in folder.iterdir():   # the one it replaces, and any a killed save left
            if old != target and _STEP_FOLDER.fullmatch(old.name) and old.is_dir():
                _remove_step_folder(old)
    return target


def _stage_part(pipe: DistributedPipe, names: dict[str, str], stage: int,
                 optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """What stage ``stage``'s file holds: its weights and its parameters' optimizer
    state, whole, on the CPU, by the unpipelined model's names. Collective where the
    stage holds parts of tensors (see the module docstring)."""
    module = _unwrapped(pipe.modules[stage])
    weights = pack_projections({k: _whole(t) for k, t in _tensors(module).items()}, torch.cat)
    moments = pack_projections({k: {key: _whole(v) if isinstance(v, Tensor) else v
                                    for key, v in optimizer.state[p].items()}
                                for k, p in module.named_parameters() if p in optimizer.state},
                               _joined)
    return {"weights": {names[k]: t for k, t in weights.items()},
            "optimizer": {names[k]: state for k, state in moments.items()}}


def _nonfinite(parts: dict[int, dict[str, dict[str, Any]]], step: int,
               folder: Path) -> str | None:
    """What of this rank's stages' weights and optimizer state (``parts``, as
    `_stage_part` gathers them) is NaN or infinite, if anything: such a checkpoint would
    only resume a diverged run, so it must not replace a good one."""
    found: dict[str, Tensor] = {}
    for part in parts.values():
        found.update(part["weights"])
        found.update((f"{name} ({key})", v) for name, state in part["optimizer"].items()
                     for key, v in state.items() if isinstance(v, Tensor))
    bad = [name for name, t in found.items()
           if t.is_floating_point() and not bool(t.isfinite().all())]
    if not bad:
        return None
    return (f"the weights or optimizer state after step {step} hold NaN or inf values "
            f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}): the run has diverged, "
            f"and saving would replace the last good checkpoint in {folder}, which is "
            f"kept. Resume from it with a lower learning rate (or clip the gradients)")


def _outside_the_pipe(pipe: DistributedPipe, optimizer: torch.optim.Optimizer,
                      what: str) -> str | None:
    """The optimizer's parameters that are not this rank's stages', if any: run_state
    saves and restores only the pipe's."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"run_state needs the run's optimizer (a torch.optim.Optimizer over "
                        f"pipe.parameters()), got {type(optimizer).__name__}")
    mine = {id(p) for p in pipe.parameters()}
    outside = [p for group in optimizer.param_groups for p in group["params"]
               if id(p) not in mine]
    if not outside:
        return None
    return (f"the optimizer holds {len(outside)} parameter(s) that are not the pipe's "
            f"(shapes {[list(p.shape) for p in outside][:3]}): their values and optimizer "
            f"state cannot be {what} with the pipe's stages. Give the optimizer "
            f"pipe.parameters() only, and save the others yourself (or make them a layer "
            f"of the model)")


def _agree_everywhere(pipe: DistributedPipe, problem: str | None) -> None:
    """Raise on every rank if ``problem`` is set on any: one all-reduce, and, only when
    some rank has one, the ranks' messages, so that all of them say the same."""
    flag = torch.tensor([problem is not None], dtype=torch.int64, device=pipe.mesh.device)
    try:
        dist.all_reduce(flag)
    except RuntimeError as exc:   # a timeout, most likely: a rank that never came
        exc.add_note("raised while run_state.save waited for every rank of the job: each "
                     "must call save(...) at the same step")
        raise
    if not flag.item():
        return
    said: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(said, problem)
    raise ValueError("; ".join(f"rank {r}: {p}" for r, p in enumerate(said) if p))


def _remove_step_folder(step_folder: Path) -> None:
    """Delete a superseded step folder: only the files `save` writes (and their
    temporary files, which a killed save leaves), and the folder if that empties it.
    Whatever else is there is someone's (a learner's notes), and the new checkpoint is
    already complete, so a file that will not go is left, not raised."""
    ours = [RUN, *(p.name for p in step_folder.glob("stage-*.pt")),
            *(p.name for p in step_folder.glob(f".*{PART}"))]
    for name in ours:
        try:
            (step_folder / name).unlink(missing_ok=True)
        except OSError:
            pass
    try:
        step_folder.rmdir()
    except OSError:
        pass


@contextlib.contextmanager
def claimed(folder: str | Path) -> Iterator[None]:
    """Hold ``folder`` for one run's saves (call it on one rank, e.g. rank 0, around the
    training loop). Two runs saving into one folder would each move ``latest`` to their
    own step and delete the other's, or, at the same step, mix their stages' files: so a
    second run is refused while the first holds the folder. An OS lock (``flock``) on
    ``folder/.lock``, released when the process ends however it ends, so a killed run
    leaves no stale claim."""
    import fcntl   # POSIX only, as torchrun's multi-process jobs are here
    folder = Path(folder)
    handle = (folder / LOCK).open("a")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another run is saving into {folder} (it holds "
                               f"{folder / LOCK}): two runs in one folder delete each "
                               f"other's checkpoints; give this one another --save folder, "
                               f"or wait for the other to end") from None
        yield
    finally:
        handle.close()


def _latest(folder: Path, missing_ok: bool = False) -> Path | None:
    """The step folder ``folder/latest`` names. With ``missing_ok``, None when there is
    no valid one (for `save`, which replaces it): a name that is not a step folder of
    ``folder`` (an edited ``latest``: ``.``, ``../x``) is never one to delete."""
    marker = folder / LATEST
    if not marker.is_file():
        if missing_ok:
            return None
        raise FileNotFoundError(f"{folder} holds no checkpoint ({marker} is missing): give "
                                f"the folder a run saved into with --save")
    name = marker.read_text().strip()
    if not _STEP_FOLDER.fullmatch(name) or not (folder / name / RUN).is_file():
        if missing_ok:
            return None
        raise FileNotFoundError(f"{marker} names {name!r}, which is not a complete step "
                                f"folder of {folder} (no {name or '?'}/{RUN}): the checkpoint "
                                f"was moved or edited; write the name of a step-NNNNNN "
                                f"folder there that holds {RUN}")
    return folder / name


def _load(path: Path, **kwargs: Any) -> Any:
    """``torch.load`` of a checkpoint file, failing with the file's name and what to do."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except FileNotFoundError:
        raise FileNotFoundError(f"the checkpoint is incomplete: {path} is missing (was the "
                                f"folder copied in part?); copy it back, or resume from "
                                f"another checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes torch.load raise
        raise RuntimeError(f"the checkpoint file {path} is damaged and cannot be read "
                           f"({str(exc).splitlines()[0][:120]}); resume from another "
                           f"copy of the run's --save folder") from None


def _read(folder: str | Path) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, dict]]:
    """The newest checkpoint in ``folder``: its run record, every stage's weights and every
    parameter's optimizer state, by unpipelined names."""
    step_folder = _latest(Path(folder))
    run = _load(step_folder / RUN)
    weights: dict[str, Tensor] = {}
    moments: dict[str, dict] = {}
    for s in range(run["stages"]):
        part = _load(step_folder / _stage_file(s), mmap=True)
        weights.update(part["weights"])
        moments.update(part["optimizer"])
    return run, weights, moments


def merged_state_dict(folder: str | Path) -> dict[str, Tensor]:
    """The newest checkpoint in ``folder`` as the unpipelined model's state dict:
    ``transformer_lm(...).load_state_dict(merged_state_dict(DIR))``."""
    return _read(folder)[1]


def _state_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> set[str]:
    """The state a step of ``optimizer`` keeps per parameter of ``group``, with its
    settings (Adam: ``step``, ``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` with
    ``amsgrad``), found by a step on a one-element stand-in; empty where no such step
    can be taken (an optimizer needing a closure): nothing is then checked."""
    if not group["params"]:
        return set()
    like = group["params"][0]
    stand_in = torch.zeros(1, dtype=like.dtype, device=like.device, requires_grad=True)
    stand_in.grad = torch.zeros_like(stand_in)
    try:
        probe = type(optimizer)([{**{k: v for k, v in group.items() if k != "params"},
                                  "params": [stand_in]}])
        probe.step()
    except Exception:  # noqa: BLE001 - an optimizer that cannot be probed so
        return set()
    return set(probe.state[stand_in])


def _by_parameter(module: nn.Module, saved: dict[str, T], split: Callable[[T], list[T]]
                  ) -> dict[str, T]:
    """``saved`` (by state-dict key) by ``module``'s parameter names: a packed projection
    split (``split``) where the stage holds it as three (a `ShardableBlock`)."""
    own = _tensors(_unwrapped(module))
    return {**{k: v for k, v in saved.items() if k in own},
            **unpack_projections({k: v for k, v in saved.items() if k not in own}, split)}


def _part_like(like: Tensor, saved: Any) -> Any:
    """``saved`` (a whole tensor from a checkpoint, or a number) as ``like`` holds it: a
    parameter-shaped tensor cut to this rank's part of ``like``, a `DTensor`; anything
    else as it is."""
    if not (is_dtensor(like) and isinstance(saved, Tensor)
            and saved.shape == like.shape):
        return saved
    from torch.distributed.tensor import distribute_tensor   # loaded: like is a DTensor
    return distribute_tensor(saved.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)


def _load_parts(module: nn.Module, saved: dict[str, Tensor]) -> None:
    """Copy the whole tensors of ``saved`` (by parameter name) into ``module``'s
    parameters and buffers, each rank its own part of a `DTensor`."""
    with torch.no_grad():
        for name, t in _tensors(module).items():
            whole = saved[name]
            if whole.shape != t.shape:
                raise RuntimeError(f"size mismatch for {name}: copying a param with shape "
                                   f"{list(whole.shape)} from checkpoint, the shape in "
                                   f"current model is {list(t.shape)}")
            part = _part_like(t, whole.to(t.dtype))
            (t.to_local() if is_dtensor(t) else t).copy_(
                part.to_local() if is_dtensor(part) else part)


def resume(folder: str | Path, pipe: DistributedPipe, balance: Sequence[int],
           optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint in ``folder`` into this rank's stages, its optimizer and
    the random generator; return the number of steps it had run. The layout (pp, dp,
    balance, schedule) may differ from the saved run's; the model may not. The optimizer
    gets each parameter's saved state and keeps its own settings (lr, weight decay, its
    groups): see the module's docstring."""
    outside = _outside_the_pipe(pipe, optimizer, "restored")
    if outside:
        raise ValueError(outside)
    run, weights, moments = _read(folder)
    names = full_names(pipe, balance)
    another = (f"it was saved from another model; resume with the same --preset and "
               f"data")
    beyond = sorted({int(k.partition(".")[0]) for k in weights} - set(range(sum(balance))))
    if beyond:   # each rank sees only its layers: layers past the model's end are extra
        raise ValueError(f"the checkpoint in {folder} has layers {beyond[:3]}"
                         f"{' ...' if len(beyond) > 3 else ''} and this model only "
                         f"{sum(balance)}: {another}")
    saved_optimizer = run.get("optimizer", type(optimizer).__name__)
    if saved_optimizer != type(optimizer).__name__:
        raise ValueError(f"the checkpoint in {folder} holds {saved_optimizer}'s state and "
                         f"settings, and this run's optimizer is "
                         f"{type(optimizer).__name__}: resume with {saved_optimizer}")
    places = _param_places(pipe)
    saved_state = {s: _by_parameter(module, {local: moments[full]
                                             for local, full in names[s].items()
                                             if full in moments}, _split)
                   for s, module in pipe.modules.items()}
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:   # its own settings, the saved state
        needs, indices = _state_keys(optimizer, group), []
        for p in group["params"]:
            s, local = places[id(p)]
            saved = saved_state[s].get(local)
            if saved is not None:
                if needs - set(saved):
                    raise ValueError(
                        f"the checkpoint's optimizer state of {names[s][packed_name(local)]} "
                        f"has no {sorted(needs - set(saved))}, which this "
                        f"{type(optimizer).__name__}'s settings need: it was saved with "
                        f"other settings (amsgrad?); resume with the settings it was "
                        f"saved with")
                state[index] = {key: _part_like(p, v) for key, v in saved.items()}
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": indices})
    for s, module in pipe.modules.items():
        wanted = names[s]
        missing = [full for full in wanted.values() if full not in weights]
        layers = {full.partition(".")[0] for full in wanted.values()}
        extra = [k for k in weights if k.partition(".")[0] in layers
                 and k not in wanted.values()]
        if missing or extra:
            raise ValueError(f"the checkpoint in {folder} "
                             + (f"has no {missing[:3]}{' ...' if len(missing) > 3 else ''}"
                                if missing else f"has {extra[:3]}, which this model lacks")
                             + f": {another}")
        saved_weights = {local: weights[full] for local, full in wanted.items()}
        try:
            if _is_split(pipe):
                _load_parts(_unwrapped(module), _by_parameter(module, saved_weights,
                                                              lambda t: list(t.chunk(3))))
            else:
                _unwrapped(module).load_state_dict(saved_weights)
        except RuntimeError as exc:   # shapes: another width or vocabulary
            raise ValueError(f"the checkpoint in {folder} does not fit stage {s}: {another}"
                             f"\n{exc}") from None
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(run["rng"])
    return run["step"]
