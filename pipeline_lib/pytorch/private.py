"""PyTorch's private pipelining API, imported here and nowhere else.

Running a schedule of our own in PyTorch needs names that ``torch.distributed.pipelining``
keeps private (a leading underscore: no promise they stay): the runtime that executes a
per-rank list of actions, `_PipelineScheduleRuntime`, with its ``_load_csv``; the
action type `_Action`; the lowering passes `_add_send_recv`, `_add_unshard_reshard` and
`_add_reduce_grad`, and `_validate_schedule`; the schedule visualiser's
``get_schedule_ops``, which builds PyTorch's own schedules without processes; and the
stages' base class `_PipelineStageBase` (what the tracer's stages are), whose
per-micro-batch methods notebook 06's worker times.
torchtitan imports the same names for its ``pipeline_parallel_schedule_csv``.

Every module of this suite reaches them through this one, by our names (``private.Runtime``,
``private.Action``, ...), looked up on first use: importing `pipeline_lib` never fails
because of them. On that first use the names are checked (each exists, and the members we
call on it), and a PyTorch whose version this suite was not tested with gets a warning; a
name that moved is a `PrivateAPIMoved` error saying which, where it was, and which
versions are tested.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from typing import Any, Sequence

import torch

#: The torch releases (major.minor) whose private pipelining API this suite was run against.
TESTED_VERSIONS = ("2.13",)

_SCHEDULES = "torch.distributed.pipelining.schedules"
_VISUALIZER = "torch.distributed.pipelining._schedule_visualizer"

#: our name -> (module, PyTorch's name, the members we use on it)
NAMES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "Runtime": (_SCHEDULES, "_PipelineScheduleRuntime", ("_load_csv", "step")),
    "Action": (_SCHEDULES, "_Action",
               ("from_str", "stage_index", "computation_type", "microbatch_index",
                "sub_actions")),
    "add_send_recv": (_SCHEDULES, "_add_send_recv", ()),
    "add_unshard_reshard": (_SCHEDULES, "_add_unshard_reshard", ()),
    "add_reduce_grad": (_SCHEDULES, "_add_reduce_grad", ()),
    "validate_schedule": (_SCHEDULES, "_validate_schedule", ()),
    "get_schedule_ops": (_VISUALIZER, "get_schedule_ops", ()),
    "StageBase": ("torch.distributed.pipelining.stage", "_PipelineStageBase",
                  ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")),
}
#: keyword arguments we pass, which a release could rename
_PARAMETERS = {"Runtime._load_csv": ("filename", "format"),
               "get_schedule_ops": ("schedule", "pp_degree", "num_microbatches",
                                    "num_stages_per_rank", "with_comms")}


class PrivateAPIMoved(ImportError):
    """A private name of ``torch.distributed.pipelining`` this suite uses is gone or changed."""


def _version() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _moved(what: str) -> PrivateAPIMoved:
    return PrivateAPIMoved(
        f"{what} in torch {torch.__version__}: pipeline_lib.pytorch runs schedules in PyTorch "
        f"through this private API of torch.distributed.pipelining, which may change in any "
        f"release. It is tested with torch {', '.join(TESTED_VERSIONS)}: install one "
        f"(pip install torch=={TESTED_VERSIONS[-1]}.0, as requirements.txt pins), or adapt "
        f"pipeline_lib/pytorch/private.py to where the name went")


def _load(ours: str) -> Any:
    module_name, theirs, members = NAMES[ours]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _moved(f"the module {module_name} is missing") from exc
    if not hasattr(module, theirs):
        raise _moved(f"{module_name}.{theirs} is missing")
    value = getattr(module, theirs)
    gone = [m for m in members if not hasattr(value, m)]
    if gone:
        raise _moved(f"{module_name}.{theirs} has no {', '.join(gone)}")
    return value


def _check_parameters(name: str, function: Any) -> None:
    wanted = _PARAMETERS.get(name, ())
    have = inspect.signature(function).parameters
    missing = [p for p in wanted if p not in have]
    if missing:
        raise _moved(f"{name} takes no parameter {', '.join(missing)} (it takes "
                     f"{', '.join(have)})")


_warned = False


def _warn_if_untested() -> None:
    global _warned
    if not _warned and _version() not in TESTED_VERSIONS:
        _warned = True
        warnings.warn(f"torch {torch.__version__}: pipeline_lib.pytorch uses private names of "
                      f"torch.distributed.pipelining and was tested with torch "
                      f"{', '.join(TESTED_VERSIONS)}; they are all present here, but their "
                      f"behaviour may have changed", stacklevel=3)


def __getattr__(name: str) -> Any:
    """``private.Runtime`` and the rest of `NAMES`, checked on first use, then cached (as
    a global of this module, so Python finds it without calling this again)."""
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; the private "
                             f"names it provides are {sorted(NAMES)}")
    if name in globals():
        return globals()[name]
    _warn_if_untested()
    value = _load(name)
    if name == "Runtime":
        _check_parameters("Runtime._load_csv", value._load_csv)
    elif name in _PARAMETERS:
        _check_parameters(name, value)
    globals()[name] = value
    return value


def schedule_ops(name: str, ranks: int, microbatches: int, virtual_stages: int | None = None,
                 with_comms: bool = False) -> list[list[Any]]:
    """PyTorch's own schedule ``name`` ("GPipe", "Interleaved1F1B", ...) as per-rank lists
    of `_Action` (``None`` for an idle step), built without processes by its visualiser;
    lowered, with sends and receives, if ``with_comms``. Its private-API warning and its
    log lines about the idle steps it adds are silenced; its errors (a micro-batch count
    the schedule refuses) pass through."""
    ops = __getattr__("get_schedule_ops")
    logger = logging.getLogger(_SCHEDULES)
    level = logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logger.setLevel(logging.ERROR)
        try:
            return ops(name, ranks, microbatches, virtual_stages, with_comms=with_comms)
        finally:
            logger.setLevel(level)


def runtime_lowering(rows: Sequence[Sequence[str]], stages: int, microbatches: int
                     ) -> list[list[str]]:
    """What PyTorch's runtime runs after loading the ``compute_only`` program ``rows`` (one
    list of action strings per rank, `Schedule.to_pytorch`): its own lowering, done as
    ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` does it (validate and place
    the stages; ``UNSHARD``/``RESHARD`` and ``REDUCE_GRAD`` per rank; then the sends and
    receives, each receive placed when its sender sends), without processes. The tests
    check it against PyTorch's own schedules lowered by its visualiser."""
    actions = {rank: [__getattr__("Action").from_str(cell) for cell in row]
               for rank, row in enumerate(rows)}
    where = __getattr__("validate_schedule")(actions, len(actions), stages, microbatches)
    for rank in actions:
        actions[rank] = __getattr__("add_reduce_grad")(
            __getattr__("add_unshard_reshard")(actions[rank]), microbatches)
    ranks = len(actions)              # the pass below empties ``actions``
    lowered = __getattr__("add_send_recv")(actions, where.__getitem__, stages)
    return [[str(a) for a in lowered[rank]] for rank in range(ranks)]
