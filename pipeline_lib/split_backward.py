"""The split backward of the zero-bubble schedules: I (input gradients) now, W (weight
gradients) later, with W resuming where I left off instead of walking the graph again.

Autograd cannot pause a backward half-way, so a naive W re-runs ``backward(outputs,
inputs=params)`` from the stage's outputs: it recomputes every gradient that leads to a
weight, including all the activation gradients I already computed, and costs about a full
backward. What W really needs is, for every weight, the gradient that reached the last node
on its path that I also ran (an ``AddmmBackward`` whose other branch leads to the stage's
input, say). I computes exactly those gradients on its way to the input; hooks on those
*frontier* nodes keep them, and W starts from the frontier with them. W then runs only the
weight branches (the ``x.T @ grad`` products), which is what the paper's W is. The price
is memory: from I to W a micro-batch keeps, besides its graph, the gradient at every
branch point (about one activation per layer with weights), which is part of what
deferring W costs in the zero-bubble schedules; PyTorch's ``stage_backward_input`` keeps
the same.

Where one weight sits below several frontier nodes (a weight used twice, or below a node
that also leads to another frontier node), W seeds all of them in one call; a pre-hook then
hands each frontier node the gradient I saw there, so that a gradient flowing into it from
another seeded node is not counted twice. One group's walk may also run nodes of the input
path that another group needs (a weight used on both sides of another weighted layer), so
W keeps the graph until its last call.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Grads = dict[int, Tensor]          # output index of a node -> gradient reaching it


def _node(t: Tensor) -> Node:
    return get_gradient_edge(t).node


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Each node of the graph below ``roots`` -> the nodes whose backward feeds it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _ancestors(starts: list[Node], parents: dict[Node, list[Node]],
               stop: set[Node] | frozenset = frozenset()) -> set[Node]:
    """``starts`` and every node from which one of them can be reached, not looking past
    the nodes in ``stop``."""
    found, queue = set(starts), deque(starts)
    while queue:
        node = queue.popleft()
        if node in stop:
            continue
        for parent in parents.get(node, ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


@contextlib.contextmanager
def _explain_reentrant_checkpoint() -> Iterator[None]:
    """PyTorch's error for a reentrant checkpoint in a split backward says to use
    .backward() without ``inputs``, which the split cannot do: say what can be done."""
    try:
        yield
    except RuntimeError as error:
        if "use_reentrant=True" not in str(error):
            raise
        raise RuntimeError("a stage runs torch.utils.checkpoint with use_reentrant=True, "
                           "whose backward cannot be split into I (input gradients) and W "
                           "(weight gradients) as this schedule does; pass "
                           "use_reentrant=False to torch.utils.checkpoint (or let the pipe "
                           "checkpoint: Pipe(..., checkpoint='always')), or use a schedule "
                           "with full backwards (gpipe, 1f1b, interleaved_1f1b)") from error


@dataclass(eq=False)
class _Group:
    """Weights that share frontier nodes, and those nodes (W runs one call per group)."""
    params: list[Tensor] = field(default_factory=list)
    frontier: set[Node] = field(default_factory=set)
    roots: set[Node] = field(default_factory=set)   # outputs' nodes I never ran


@dataclass
class WeightGradients:
    """What I leaves for W: the weight groups and the gradients seen at their frontier."""
    groups: list[_Group]
    seen: dict[Node, Grads]
    root_grads: dict[Node, Grads]

    def run(self) -> None:
        """W: accumulate every weight's gradient into ``.grad``, freeing the graph.

        Each group's call keeps the graph (``retain_graph``) but the last: one group's
        walk may pass through nodes another's needs (``c.weight = a.weight`` with ``b``
        between: the walk from c down to a's use runs b's node, whose saved tensors W of
        b's weight reads). The graph is freed all the same when W drops it, at the end."""
        for k, group in enumerate(self.groups):
            seeds = [(node, self.seen.get(node, {})) for node in group.frontier]
            seeds += [(node, self.root_grads[node]) for node in group.roots]
            edges = [(GradientEdge(node, i), g) for node, grads in seeds
                     for i, g in grads.items()]
            if not edges:      # no gradient reached these weights: they get none
                continue
            hooks = [node.register_prehook(
                lambda given, grads=self.seen.get(node, {}): tuple(
                    grads.get(i) for i in range(len(given))))
                for node in group.frontier]
            # backward, not grad: accumulation hooks (DDP's all-reduce) must fire
            try:
                with _explain_reentrant_checkpoint():
                    torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                            inputs=group.params,
                                            retain_graph=k < len(self.groups) - 1)
            finally:
                for hook in hooks:
                    hook.remove()
        self.groups, self.seen, self.root_grads = [], {}, {}


def backward_input(outputs: list[Tensor], grads: list[Tensor | None], inputs: list[Tensor],
                   params: list[Tensor]) -> tuple[list[Tensor | None], WeightGradients]:
    """I: the gradients of ``inputs``, and what W needs to finish the weights later."""
    roots = [_node(t) for t in outputs]
    parents = _parents(roots)
    input_side = _ancestors([_node(t) for t in inputs], parents)
    root_grads: dict[Node, Grads] = defaultdict(dict)
    for t, g in zip(outputs, grads):      # one tensor may be output twice (sent and stashed)
        edge, g = get_gradient_edge(t), torch.ones_like(t) if g is None else g
        at = root_grads[edge.node]
        at[edge.output_nr] = at[edge.output_nr] + g if edge.output_nr in at else g

    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}        # frontier or root node -> its group
    for p in params:
        weight = _node(p)
        if weight not in parents and weight not in root_grads:   # the graph does not use p
            continue                         # (an output may be p itself: a stashed weight)
        above = _ancestors([weight], parents, stop=input_side)
        frontier = {n for n in above if n in input_side}
        stuck = {n for n in above if n in root_grads and n not in input_side}
        merged = {id(group_of[n]): group_of[n] for n in frontier | stuck if n in group_of}
        group = _Group()
        for old in merged.values():
            group.params += old.params
            group.frontier |= old.frontier
            group.roots |= old.roots
            groups.remove(old)
        group.params.append(p)
        group.frontier |= frontier
        group.roots |= stuck
        groups.append(group)
        for n in group.frontier | group.roots:
            group_of[n] = group

    seen: dict[Node, Grads] = {}
    hooks = [node.register_prehook(
        lambda given, node=node: seen.__setitem__(
            node, {i: g for i, g in enumerate(given) if g is not None}))
        for group in groups for node in group.frontier]
    try:
        with _explain_reentrant_checkpoint():
            found = (list(torch.autograd.grad(outputs, inputs, grads, retain_graph=True,
                                              allow_unused=True)) if inputs and outputs
                     else [None] * len(inputs))
    finally:
        for hook in hooks:
            hook.remove()
    return found, WeightGradients(groups, seen, dict(root_grads))
