"""Checks of notebook 05's exercises (a pipeline replicated with DDP), and the cost model
that grades exercise 5.1.

The cost model (`Cluster`, `grid_problem`, `communication_seconds`, `cheapest_grid`)
lives here, with the grader, not in the notebook's worker: it is the answer to 5.1, so it
is withheld during the learner's call, and the expected grid is computed before. Each
``check_5_N`` raises `ExerciseFailed` on a wrong answer; the notebook's ``with
exercise(...)`` prefixes the exercise's name.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


# -- where the ranks go: the cost model of exercise 5.1 ----------------------------------------

Grid = tuple[list[list[int]], list[list[int]]]   # (pipelines, DDP groups) of global ranks


@dataclass(frozen=True)
class Cluster:
    """``machines`` × ``gpus`` processes, global rank r on machine ``r // gpus``: two GPUs of
    one machine talk at ``fast`` bytes/s (NVLink), two machines at ``slow`` (the network)."""

    machines: int
    gpus: int
    fast: float
    slow: float

    def bandwidth(self, a: int, b: int) -> float:
        return self.fast if a // self.gpus == b // self.gpus else self.slow


def grid_problem(pipelines: list[list[int]], dp_groups: list[list[int]], pp: int,
                 dp: int) -> str | None:
    """What makes ``(pipelines, dp_groups)`` no ``dp × pp`` grid of ranks ``0 .. dp·pp − 1``,
    or None: ``dp`` pipelines of ``pp`` ranks, every rank once, and DDP group ``s`` holding
    stage ``s`` of every pipeline (``dp_groups[s][d] == pipelines[d][s]``)."""
    try:
        pipelines = [[int(r) for r in p] for p in pipelines]
        dp_groups = [[int(r) for r in g] for g in dp_groups]
    except (TypeError, ValueError):
        return (f"return two lists of lists of ranks (pipelines, dp_groups), got "
                f"{pipelines!r} and {dp_groups!r}")
    if [len(p) for p in pipelines] != [pp] * dp:
        return f"expected {dp} pipelines of {pp} ranks, got {pipelines}"
    ranks = sorted(r for p in pipelines for r in p)
    if ranks != list(range(pp * dp)):
        return f"the pipelines must hold every rank 0..{pp * dp - 1} once, they hold {ranks}"
    columns = [[p[s] for p in pipelines] for s in range(pp)]
    if dp_groups != columns:
        return (f"DDP group s holds stage s of every pipeline: with pipelines {pipelines} "
                f"they are {columns}, got {dp_groups}")
    return None


def communication_seconds(cluster: Cluster, grid: Grid, all_reduce_bytes: float,
                          pipeline_bytes: float) -> tuple[float, float]:
    """Seconds per step spent on (pipeline messages, gradient all-reduce) with ``grid``.

    A pipeline boundary moves ``pipeline_bytes`` (every micro-batch's activation forward
    and its gradient back) over the link between its two ranks; a DDP group's ring
    all-reduce sends ``all_reduce_bytes`` from each rank, at the pace of the group's slowest
    link. Groups of one kind run at once, so the slowest counts; the two kinds add up. A
    deliberately simple model: no overlap with compute, no two groups sharing a link."""
    pipelines, dp_groups = grid
    pipeline = max((pipeline_bytes / cluster.bandwidth(a, b)
                    for p in pipelines for a, b in zip(p, p[1:])), default=0.0)
    all_reduce = max((all_reduce_bytes / min(cluster.bandwidth(a, b) for a in g for b in g
                                             if a != b)
                      for g in dp_groups if len(g) > 1), default=0.0)
    return pipeline, all_reduce


def cheapest_grid(cluster: Cluster, pp: int, dp: int, all_reduce_bytes: float,
                  pipeline_bytes: float) -> Grid:
    """The grid that spends the least time communicating, found by trying every order of
    the ranks: (dp·pp)! grids, fine for the handful of ranks of an exercise."""
    if pp * dp != cluster.machines * cluster.gpus or pp * dp > 8:
        raise ValueError(f"pp × dp = {pp * dp} must equal the cluster's "
                         f"{cluster.machines * cluster.gpus} GPUs, and at most 8 ranks can be "
                         f"tried one order at a time")

    def grid(order: tuple[int, ...]) -> Grid:
        pipelines = [list(order[d * pp:(d + 1) * pp]) for d in range(dp)]
        return pipelines, [[p[s] for p in pipelines] for s in range(pp)]

    return min((grid(order) for order in itertools.permutations(range(pp * dp))),
               key=lambda g: sum(communication_seconds(cluster, g, all_reduce_bytes,
                                                       pipeline_bytes)))


CLUSTER_5_1 = Cluster(machines=2, gpus=2, fast=300e9, slow=25e9)   # NVLink, 200 Gb/s network


def jobs_5_1() -> dict[str, tuple[float, float]]:
    """Exercise 5.1's jobs: (bytes each rank all-reduces, bytes through a pipeline boundary)
    per step. Their ratios go both ways, and the last two sit on either side of 1 (about
    0.75 and 1.5): a rule of thumb ("DDP moves over ten times the bytes") picks the wrong
    grid for one, and so does a comparison of bytes off by a factor of 2 either way."""
    ring = 2 * (2 - 1) / 2
    tutorial_stage = 722_145_390   # the larger stage of PRESETS["tutorial"] split in 2 by
    #                                parameters (notebook 05's table computes it on `meta`)
    return {"the tutorial's model (about 1.44 billion parameters, 2 stages)":
                (ring * tutorial_stage * 4, 2 * 20 * 35 * 4096 * 4),
            "a 30M-parameter stage fed 32 rows × 8,192 tokens of width 1,024":
                (ring * 30e6 * 4, 2 * 32 * 8192 * 1024 * 4),
            "a 50M-parameter stage fed 16 rows × 2,048 tokens of width 1,024":
                (ring * 50e6 * 4, 2 * 16 * 2048 * 1024 * 4),
            "a 100M-parameter stage fed 16 rows × 2,048 tokens of width 1,024":
                (ring * 100e6 * 4, 2 * 16 * 2048 * 1024 * 4)}


def _job(rng: Any) -> tuple[str, tuple[float, float]]:
    """A job drawn for this run: bytes all-reduced and bytes through a boundary, their
    ratio anywhere from 1/20 to 20."""
    all_reduce = rng.randint(1, 400) * 1e7
    return (f"a job drawn for this run", (all_reduce, all_reduce * 20 ** rng.uniform(-1, 1)))


@ignores_namespace(1)
def check_5_1(place_ranks: Callable[..., Any]) -> None:
    """Exercise 5.1: for every job (the notebook's four, and three drawn for this run), a
    valid 2 × 2 grid that communicates no longer than the cheapest one. The grader's cost
    model is withheld while ``place_ranks`` runs; a message gives the learner's grid and
    its seconds, not the cheapest grid or its seconds (on 2 × 2 ranks there are only two
    kinds of grid, so either would give the answer away)."""
    cluster = CLUSTER_5_1
    jobs = list(jobs_5_1().items()) + hidden_cases(_job, 3)
    for job, (all_reduce, pipeline) in jobs:
        best = cheapest_grid(cluster, 2, 2, all_reduce, pipeline)
        least = communication_seconds(cluster, best, all_reduce, pipeline)
        with withheld(cheapest_grid, communication_seconds):
            grid = place_ranks(all_reduce, pipeline, cluster.fast, cluster.slow)
        _require(isinstance(grid, (tuple, list)) and len(grid) == 2,
                 f"return a tuple (pipelines, dp_groups), got {grid!r}")
        problem = grid_problem(*grid, pp=2, dp=2)
        _require(problem is None, f"{job}: {problem}")
        mine = communication_seconds(cluster, grid, all_reduce, pipeline)
        _require(sum(mine) <= sum(least) * (1 + 1e-9),
                 f"{job} ({all_reduce / 1e6:,.0f} MB all-reduced, {pipeline / 1e6:,.0f} MB "
                 f"through each pipeline boundary per step): pipelines {grid[0]} with DDP "
                 f"groups {grid[1]} communicate {sum(mine) * 1e3:.2f} ms per step "
                 f"({mine[0] * 1e3:.2f} pipeline + {mine[1] * 1e3:.2f} all-reduce), and "
                 f"another grid communicates less. Cost each grid you consider the same "
                 f"way, every group's bytes over the bandwidth of its slowest link, rather "
                 f"than with a rule of thumb")


# -- 5.2: bytes per step, counted --------------------------------------------------------------

Case52 = tuple[list[nn.Module], Tensor, int, list[int], list[int], int]


def _frozen(module: nn.Module, name: str) -> nn.Module:
    module.get_parameter(name).requires_grad_(False)
    return module


def _trainable(stage: nn.Module) -> int:
    return sum(p.numel() for p in stage.parameters() if p.requires_grad)


def _mlp_case(widths: tuple[int, ...], rows: int, microbatches: int, dtype: torch.dtype,
              frozen: str) -> Case52:
    """A 3-stage MLP ``Linear, BatchNorm1d, ReLU | Linear | Linear`` of ``widths``, its
    parameter ``frozen`` frozen: the BatchNorm's running statistics are buffers, and the
    frozen parameter has no gradient, so neither is all-reduced."""
    a, b, c, d = widths
    mlp = _frozen(nn.Sequential(nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU(), nn.Linear(b, c),
                                nn.Linear(c, d)).to(dtype), frozen)
    stages = [mlp[0:3], mlp[3:4], mlp[4:5]]
    size = torch.empty((), dtype=dtype).element_size()
    return (stages, torch.zeros(rows, a, dtype=dtype), microbatches,
            [_trainable(stage) for stage in stages], [rows * b, rows * c], size)


def cases_5_2() -> dict[str, Case52]:
    """name: (stages, micro-batch, micro-batches, trainable parameters per stage, values
    per activation at each boundary, bytes per value): a small Transformer LM cut in two,
    and a 3-stage float64 MLP (8-byte values: an answer that assumes 4 bytes fails) with a
    BatchNorm (buffers) and a frozen bias (no gradient)."""
    from pipeline_lib.lm.model import transformer_lm
    from pipeline_lib.partition import layer_params
    torch.manual_seed(0)
    lm = transformer_lm(vocab_size=300, d_model=16, nhead=2, d_hid=32, nlayers=2, dropout=0.0)
    sizes = layer_params(lm)
    return {
        "a small Transformer LM in 2 stages": (
            [lm[0:3], lm[3:]], torch.randint(0, 300, (2, 7)), 4,
            [sum(sizes[:3]), sum(sizes[3:])], [2 * 7 * 16], 4),
        "the float64 MLP in 3 stages (a BatchNorm, a frozen bias)":
            _mlp_case((10, 40, 24, 3), 5, 6, torch.float64, "3.bias")}


def _drawn_5_2(rng: Any) -> tuple[tuple[int, ...], int, int, str, str, int]:
    """An MLP drawn for this run: widths, rows per micro-batch, micro-batches, element
    type, the parameter frozen, and dp."""
    return (tuple(rng.randint(2, 48) for _ in range(4)), rng.randint(2, 9), rng.randint(1, 16),
            rng.choice(["float32", "float64", "bfloat16"]),
            rng.choice(["0.weight", "0.bias", "3.weight", "3.bias", "4.weight", "4.bias"]),
            rng.randint(2, 16))


def _bytes_problem(got: float, want: float, whats: dict[str, float]) -> str:
    """Which known mistake ``got`` is ("" if none): ``whats`` maps a hint to the bytes that
    mistake gives; the right count is never said."""
    return next((f" ({hint})" for hint, wrong in whats.items()
                 if wrong != want and math.isclose(got, wrong)), "")


@ignores_namespace(1)
def check_5_2(step_bytes: Callable[..., Any]) -> None:
    """Exercise 5.2: the bytes match the trainable parameters and the activation shapes:
    on the notebook's two pipelines for ``dp`` = 2 and 4, 4-byte and 8-byte values (the
    MLP with a BatchNorm's buffers and a frozen bias, neither of which is all-reduced);
    then on an MLP whose widths, micro-batch, number of micro-batches, element type,
    frozen parameter and ``dp`` are drawn for this run. A message says whether a count is
    too large or too small and which mistake it looks like, never the count."""
    widths, rows, microbatches, dtype, frozen, dp = hidden_cases(_drawn_5_2, 1)[0]
    drawn = _mlp_case(widths, rows, microbatches, getattr(torch, dtype), frozen)
    cases = [(name, case, dp_) for name, case in cases_5_2().items() for dp_ in (2, 4)]
    cases.append((f"an MLP drawn for this run (widths {list(widths)}, {rows} rows per "
                  f"micro-batch, {microbatches} micro-batches, {dtype}, {frozen} frozen)",
                  drawn, dp))
    for name, (stages, micro, microbatches, params, values, size), dp in cases:
        answer = step_bytes(stages, micro.clone(), microbatches, dp)
        _require(isinstance(answer, (tuple, list)) and len(answer) == 2
                 and all(isinstance(part, (tuple, list)) for part in answer),
                 f"return a pair (all_reduce, boundary) of lists, got {answer!r}"[:300])
        all_reduce, boundary = answer
        _require(len(all_reduce) == len(stages) and len(boundary) == len(stages) - 1,
                 f"{name}: {len(stages)} stages have {len(stages)} all-reduces and "
                 f"{len(stages) - 1} boundaries, got {len(all_reduce)} and {len(boundary)}")
        ring = 2 * (dp - 1) / dp
        for s, got in enumerate(all_reduce):
            want = ring * params[s] * size
            every = sum(p.numel() for p in stages[s].parameters())
            buffers = sum(b.numel() for b in stages[s].buffers() if b.is_floating_point())
            _require(math.isclose(got, want),
                     f"{name}, dp = {dp}: all_reduce[{s}] is {got:,.0f} bytes, "
                     f"{'more' if got > want else 'less'} than each rank of a ring all-reduce "
                     f"sends: 2(dp − 1)/dp × the bytes of the stage's gradients, one per "
                     f"parameter that requires a gradient"
                     + _bytes_problem(got, want, {
                         "a frozen parameter, requires_grad=False, has no gradient to "
                         "all-reduce": ring * every * size,
                         "buffers, such as BatchNorm's running statistics, are no "
                         "gradients": ring * (params[s] + buffers) * size,
                         "the ring's 2(dp − 1)/dp is missing": params[s] * size,
                         f"these values are {size} bytes each: element_size() says":
                             ring * params[s] * 4}))
        for s, got in enumerate(boundary):
            want = 2 * microbatches * values[s] * size
            _require(math.isclose(got, want),
                     f"{name}, {microbatches} micro-batches: boundary[{s}] is {got:,.0f} "
                     f"bytes, {'more' if got > want else 'less'} than crosses it in a step: "
                     f"every micro-batch's activation forward and its gradient back"
                     + _bytes_problem(got, want, {
                         "the gradient goes back too: 2 (forward and backward)": want / 2,
                         "every one of the micro-batches crosses": want / microbatches,
                         f"these values are {size} bytes each: element_size() says":
                             want / size * 4}))


# -- 5.3: global gradient clipping on a dp × pp mesh -------------------------------------------

StageGrads = dict[str, Tensor]


def mesh_gradients(model: nn.Sequential, cuts: list[int], inputs: Tensor, targets: Tensor,
                   dp: int) -> list[list[StageGrads]]:
    """``grads[d][s]``: replica d's gradients of stage s's parameters (the layers
    ``cuts[s]:cuts[s + 1]``, named as in ``model``), of the mean loss over replica d's rows:
    what each rank of a ``dp × pp`` mesh holds before DDP averages."""
    grads = []
    for rows, wanted in zip(inputs.chunk(dp), targets.chunk(dp)):
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(rows), wanted).backward()
        named = dict(model.named_parameters())
        grads.append([{n: named[n].grad.clone() for n in named
                       if cuts[s] <= int(n.split(".")[0]) < cuts[s + 1]}
                      for s in range(len(cuts) - 1)])
    return grads


_TORCH_CLIPPING = ("clip_grad_norm_", "clip_grad_norm", "get_total_norm", "clip_grads_with_norm_")
_TORCH_REASON = ("your code calls torch.nn.utils.{name}, which computes the whole model's norm "
                 "in one process. Combine the ranks' own numbers instead, as the ranks of a "
                 "mesh must")


def _torch_clipping() -> list[Callable[..., Any]]:
    """PyTorch's own norm and clipping functions: called on the gathered gradients, they
    would do the one-process computation the exercise replaces by per-rank numbers
    combined across the pipeline."""
    return [getattr(torch.nn.utils, n) for n in _TORCH_CLIPPING if hasattr(torch.nn.utils, n)]


def _mesh(rng: Any) -> tuple[int, tuple[int, ...]]:
    """dp, and the cuts of the 7-layer MLP into 2 to 4 pipeline ranks, each with a Linear
    (the even layers), for a drawn case."""
    while True:
        cuts = (0, *sorted(rng.sample(range(1, 7), rng.randint(1, 3))), 7)
        if all(any(i % 2 == 0 for i in range(a, b)) for a, b in zip(cuts, cuts[1:])):
            return rng.randint(2, 4), cuts


@ignores_namespace(1)
def check_5_3(clip_global: Callable[..., Any]) -> None:
    """Exercise 5.3: every replica's every stage ends with the gradient that
    ``torch.nn.utils.clip_grad_norm_`` leaves in the unpipelined model trained on the whole
    batch, and the returned norm is that model's, for a clip that bites and one that does
    not; on 2 replicas × 3 uneven pipeline ranks, and on a mesh drawn for this run.
    `pipeline_lib.grad_clip.clip_grad_norm_` and PyTorch's norm and clipping functions are
    withheld."""
    shown = [(2, (0, 2, 5, 7))]
    for dp, cuts in shown + hidden_cases(_mesh, 1, shown=shown):
        _check_clip(clip_global, dp, list(cuts))


def _check_clip(clip_global: Callable[..., Any], dp: int, cuts: list[int]) -> None:
    from pipeline_lib import grad_clip
    torch.manual_seed(dp * 10 + len(cuts))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    inputs, targets = torch.randn(4 * dp, 6), torch.randn(4 * dp, 4) * 3
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(inputs), targets).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    for max_norm, what in [(norm / 3, "a clip that bites"), (norm * 2, "a clip above the norm")]:
        model.zero_grad(set_to_none=True)           # the unpipelined model, whole batch
        nn.functional.mse_loss(model(inputs), targets).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        grads = mesh_gradients(model, cuts, inputs, targets, dp)
        setup = (f"{dp} replicas × {len(cuts) - 1} pipeline ranks (layers {cuts}), max_norm "
                 f"{max_norm:.3f} ({what})")
        with withheld(grad_clip.clip_grad_norm_), \
                withheld(*_torch_clipping(), reason=_TORCH_REASON):
            got = clip_global(grads, max_norm)
        _require(isinstance(got, (float, int, Tensor)) and not isinstance(got, bool),
                 f"{setup}: return the total norm before clipping, got {got!r}")
        got = float(got)
        problem = _clip_problem(grads, expected)
        _require(not problem, f"{setup}: {problem}")
        _require(math.isclose(got, expected_norm, rel_tol=1e-4),
                 f"{setup}: you returned {got:.5f}, "
                 f"{'more' if got > expected_norm else 'less'} than the whole model's "
                 f"gradient norm (the norm of the averaged gradients, before clipping)")


def _clip_problem(grads: list[list[StageGrads]], expected: StageGrads) -> str:
    """What is wrong with the gradients the learner left ("" if nothing): the replicas
    disagree, or one replica's pipeline ranks were scaled by different factors, or else
    how far off one gradient is. It points at the step that went wrong without reciting
    the recipe."""
    wrong = [(d, s, n) for d, stages in enumerate(grads) for s, stage in enumerate(stages)
             for n, g in stage.items()
             if not torch.allclose(g, expected[n], rtol=1e-4, atol=1e-6)]
    if not wrong:
        return ""
    for d, stages in enumerate(grads[1:], start=1):
        for s, stage in enumerate(stages):
            for n, g in stage.items():
                if not torch.allclose(g, grads[0][s][n], rtol=1e-4, atol=1e-6):
                    return (f"replica {d} and replica 0 end with different gradients for {n} "
                            f"(pipeline rank {s}), so their next steps would differ: what "
                            f"does every rank hold before anyone computes a norm?")
    factors = [math.sqrt(sum(g.pow(2).sum().item() for g in stage.values())
                         / sum(expected[n].pow(2).sum().item() for n in stage))
               for stage in grads[0]]
    if max(factors) > min(factors) * (1 + 1e-4):
        return (f"replica 0's pipeline ranks end scaled by different factors, "
                f"{', '.join(f'{f:.3f}' for f in factors)} times the unpipelined model's "
                f"clipped gradient: clipping scales the whole model alike, so what sets the "
                f"factor must be the same on every pipeline rank")
    d, s, n = wrong[0]
    ratio = (grads[d][s][n].norm() / expected[n].norm()).item()
    return (f"replica {d}, pipeline rank {s}: {n}'s gradient is not the unpipelined model's "
            f"after clip_grad_norm_ (its norm is {ratio:.3f} times that). Which norm decides "
            f"the factor, and when is a gradient left as it is?")
