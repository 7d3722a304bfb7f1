"""Checks of notebook 04's exercises (data-parallel primitives and the chunked loss).

Each ``check_4_N`` calls the learner's function on inputs where the usual mistakes give
different numbers, and, where the numbers alone cannot tell, watches *how* the answer
works: 4.1 records every call of the generator (which replica, how many rows and
positions), 4.3 the shape of every tensor PyTorch makes. The library functions
that compute the answer are withheld during the learner's call. A failed check raises
`ExerciseFailed`; the notebook's ``with exercise(...)`` prefixes the exercise's name.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline_lib.course.exercises import (ExerciseFailed, hidden_cases, ignores_namespace,
                                           withheld)
from pipeline_lib.lm.loops import lm_loss
from pipeline_lib.lm.model import transformer_lm


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ExerciseFailed(message)


# -- 4.1: scatter + chunked loss ---------------------------------------------------------------

class _CallLog(list):
    """A list that `copy.deepcopy` shares instead of copying: `replicate` deep-copies the
    generator, and every replica must write its calls into the check's one log."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _CallLog:
        return self


class RecordingLinear(nn.Linear):
    """`nn.Linear` that logs, its replicas included, ``(id of the module called, input
    shape)`` at every call in ``calls``, and ``(id, "F")`` / ``(id, "B")`` in ``order`` when
    a call's output goes forward and when its gradient comes back: how the learner's loss
    splits the work, and whether each chunk is backpropagated before the next is projected,
    is seen, not guessed."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.calls = _CallLog()
        self.order = _CallLog()

    def forward(self, x: Tensor) -> Tensor:
        me, order = id(self), self.order
        self.calls.append((me, tuple(x.shape)))
        out = super().forward(x)
        order.append((me, "F"))
        if out.requires_grad:
            out.register_hook(lambda grad: order.append((me, "B")))
        return out


class _CountedBody(torch.autograd.Function):
    """The identity, standing in for the body (embedding and blocks) that computed
    ``features``: its backward logs each pass, and a chunked loss must run the body's
    backward once, not per chunk."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, log: list[int]) -> Tensor:
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.log.append(1)
        return grad, None


def _withheld_4_1() -> list[Any]:
    from pipeline_lib.course import data_parallel
    return ["pipeline_lib.lm.chunked_loss", "pipeline_lib.lm.multi_device_loss",
            data_parallel.data_parallel_step]


@ignores_namespace(1)
def check_4_1(scattered_chunked_loss: Callable[..., Any]) -> None:
    """Exercise 4.1: the loss, the gradient reaching ``features`` and the generator's
    gradients equal the plain loss's; every generator call ran on one device's replica,
    with at most that device's rows and ``chunk`` positions, ceil(positions / chunk) calls
    per device, each chunk backpropagated before the next was projected; and the backward
    ran once through what computed ``features`` (a stand-in for the body). On the
    notebook's batch of 5 rows × 7 positions, and on a batch, devices and chunk drawn for
    this run."""
    shown = [(5, 7, 2, 3), (5, 7, 3, 2)]
    drawn = hidden_cases(lambda rng: (rows := rng.randint(3, 8), rng.randint(4, 11),
                                      rng.randint(2, min(rows, 4)), rng.randint(2, 5)), 1,
                         shown=shown)
    width, vocab = 16, 50
    for rows, positions, count, chunk in shown + drawn:
        torch.manual_seed(rows * 100 + positions)
        features = torch.randn(rows, positions, width)
        target = torch.randint(0, vocab, (rows, positions))
        start_generator = RecordingLinear(width, vocab)
        devices = ["cpu"] * count
        setup = f"{rows} rows × {positions} positions on {count} devices, chunks of {chunk}"
        plain_out, plain = features.clone().requires_grad_(), copy.deepcopy(start_generator)
        expected = F.cross_entropy(plain(plain_out).flatten(0, 1), target.flatten())
        expected.backward()
        start_generator.calls.clear()
        start_generator.order.clear()
        leaf, generator, body = (features.clone().requires_grad_(),
                                 copy.deepcopy(start_generator), [])
        mine = _CountedBody.apply(leaf, body)      # the body's output, as in a real model
        with withheld(*_withheld_4_1()):
            loss = scattered_chunked_loss(mine, generator, target, devices, chunk)
        _require(isinstance(loss, (float, int, Tensor)) and not isinstance(loss, bool)
                 and (not isinstance(loss, Tensor) or loss.numel() == 1),
                 f"{setup}: return the loss as a number (or a one-element tensor), got "
                 f"{loss!r}"[:300])
        loss = float(loss)
        calls = list(start_generator.calls)
        _check_calls(calls, id(generator), rows, positions, len(devices), chunk, setup)
        _check_order(list(start_generator.order), setup)
        _require(len(body) == 1,
                 f"{setup}: the backward ran {len(body)} times through the body that "
                 f"computed features (here a stand-in that counts): "
                 + ("call features.backward(...) once, with the gathered gradient of all "
                    "devices' rows (concatenated along dim 0)" if not body else
                    "cut each device's rows off the graph (.detach().requires_grad_()), "
                    "backpropagate the chunks into those cuts, and then the body once, "
                    "features.backward(gathered gradient)"))
        _check_loss_4_1(loss, expected.item(), features, target, start_generator, devices,
                        chunk, setup)
        wrong = (leaf.grad - plain_out.grad).abs().amax(dim=2) > 1e-6
        _require(not wrong.any(),
                 f"{setup}: the gradient that reached features differs from the "
                 f"plain loss's at (row, position) {wrong.nonzero()[:4].tolist()}...; "
                 f"concatenate each device's chunk gradients along dim 1, then the devices' "
                 f"along dim 0, in order")
        for name, param in generator.named_parameters():
            reference = dict(plain.named_parameters())[name].grad
            _require(param.grad is not None,
                     f"{setup}: generator.{name}.grad is None: sum the replicas' gradients "
                     f"into the generator (reduce_gradients(replicas, generator))")
            ratio = (param.grad.norm() / reference.norm()).item()
            _require(torch.allclose(param.grad, reference, rtol=1e-4, atol=1e-6),
                     f"{setup}: the weight gradient generator.{name}.grad differs from the "
                     f"plain loss's (its norm is {ratio:.2f} times the expected); every "
                     f"replica's gradient must be summed into the generator, once")


def _check_calls(calls: list[tuple[int, tuple[int, ...]]], original: int, rows: int,
                 positions: int, devices: int, chunk: int, setup: str) -> None:
    """The generator calls a correct answer makes: one replica per device, each called
    once per chunk on its rows only."""
    _require(bool(calls), f"{setup}: the generator was never called: project each chunk "
                          f"with its device's replica, replica(chunk_of_features)")
    shapes = sorted({shape for _, shape in calls})
    _require(all(module != original for module, _ in calls),
             f"{setup}: the generator itself was called (inputs {shapes}): replicate it "
             f"onto the devices and project each device's rows with its own replica")
    most_rows = math.ceil(rows / devices)
    too_big = [s for s in shapes if len(s) != 3 or s[0] > most_rows or s[1] > chunk]
    _require(not too_big,
             f"{setup}: the generator saw inputs of shape {too_big}, but a device holds at "
             f"most {most_rows} of the {rows} rows and a chunk at most {chunk} positions: "
             f"scatter the rows over the devices, then project [rows, chunk, features] "
             f"slices one at a time")
    per_replica: dict[int, int] = {}
    for module, _ in calls:
        per_replica[module] = per_replica.get(module, 0) + 1
    pieces = len(torch.empty(rows).chunk(devices))
    chunks = math.ceil(positions / chunk)
    _require(len(per_replica) == pieces and set(per_replica.values()) == {chunks},
             f"{setup}: {len(per_replica)} replicas made {sorted(per_replica.values())} "
             f"generator calls each; expected {pieces} replicas (one per device with rows) "
             f"of {chunks} calls each (ceil({positions} / {chunk}) chunks of positions), "
             f"every position projected exactly once")


def _check_order(order: list[tuple[int, str]], setup: str) -> None:
    """Each replica's chunks alternate: projected (F), backpropagated (B), then the next."""
    for module in dict.fromkeys(m for m, _ in order):
        seen = "".join(kind for m, kind in order if m == module)
        _require(seen == "FB" * (len(seen) // 2),
                 f"{setup}: a replica projected its chunks and got their gradients back in "
                 f"the order {' '.join(seen)} (F: a chunk projected, B: its gradient back); "
                 f"backpropagate each chunk's loss before projecting the next, so that its "
                 f"logits are freed first: a loss summed over the chunks and backpropagated "
                 f"once keeps every chunk's logits alive at the same time")


def _check_loss_4_1(loss: float, expected: float, features: Tensor, target: Tensor,
                    generator: nn.Module, devices: list[str], chunk: int, setup: str) -> None:
    def mean_of_means(pieces: list[tuple[Tensor, Tensor]]) -> float:
        with torch.no_grad():
            return sum(F.cross_entropy(generator(f).flatten(0, 1), t.flatten()).item()
                       for f, t in pieces) / len(pieces)

    rows = list(zip(features.chunk(len(devices)), target.chunk(len(devices))))
    columns = [(f[:, a:a + chunk], t[:, a:a + chunk]) for f, t in rows
               for a in range(0, features.size(1), chunk)]
    unweighted = {"each device's": mean_of_means(rows), "each chunk's": mean_of_means(columns)}
    mistake = [name for name, value in unweighted.items() if abs(loss - value) < 1e-4]
    why = (f"That is the average of {mistake[0]} own mean loss, so a device or chunk with "
           f"fewer tokens counts as much as a full one. " if mistake else "")
    _require(abs(loss - expected) < 1e-4,
             f"{setup}: your loss is {loss:.5f}, {loss / expected:.3g} times the batch's mean "
             f"cross-entropy. {why}Divide each chunk's summed token losses by the whole "
             f"batch's token count ({target.numel()}) and add them all up")


# -- 4.2: DDP's gradient averaging -------------------------------------------------------------

@ignores_namespace(1)
def check_4_2(average_gradients: Callable[[list[nn.Module]], None]) -> None:
    """Exercise 4.2: after the learner's averaging, every replica holds its own copy of
    the mean gradient, which equals one model's on the whole batch: with 3 replicas, and
    with a number of replicas drawn for this run."""
    for count in [3] + hidden_cases(lambda rng: rng.randint(2, 5), 1, shown=[3]):
        _check_average(average_gradients, count)


def _check_average(average_gradients: Callable[[list[nn.Module]], None], count: int) -> None:
    from pipeline_lib.course.data_parallel import reduce_gradients, replicate
    torch.manual_seed(count)
    tiny = transformer_lm(vocab_size=40, d_model=16, nhead=2, d_hid=32, nlayers=1, dropout=0.0)
    tokens, next_tokens = torch.randint(0, 40, (2, 2 * count, 5))   # 2 rows per replica
    one_model = copy.deepcopy(tiny)
    lm_loss(one_model(tokens), next_tokens).backward()
    replicas = replicate(tiny, ["cpu"] * count)
    for replica, rows, targets in zip(replicas, tokens.chunk(count), next_tokens.chunk(count)):
        lm_loss(replica(rows), targets).backward()
    with withheld(reduce_gradients):
        average_gradients(replicas)
    for name, expected in one_model.named_parameters():
        grads = [dict(r.named_parameters())[name].grad for r in replicas]
        _require(all(g is not None for g in grads),
                 f"{name}: a replica's .grad is None; every replica must keep a gradient")
        differ = [k for k, g in enumerate(grads) if not torch.equal(g, grads[0])]
        _require(not differ, f"{count} replicas, {name}: replicas {differ} end with a "
                             f"different gradient from replica 0; the all-reduce leaves the "
                             f"same mean in every replica")
        ratio = (grads[0].norm() / expected.grad.norm()).item()
        _require(torch.allclose(grads[0], expected.grad, rtol=1e-4, atol=1e-6),
                 f"{count} replicas, {name}: the replicas' gradient is {ratio:.2f} times "
                 f"one model's on the whole batch (norms); each replica's loss is already a "
                 f"mean over its rows, "
                 f"so the replicas' gradients are averaged (divided by {len(replicas)}), "
                 f"not summed")
        _require(len({g.data_ptr() for g in grads}) == len(grads),
                 f"{name}: the replicas share one gradient tensor; give each replica its "
                 f"own copy (on a GPU each lives on its own device)")


# -- 4.3: vocabulary-parallel cross-entropy ----------------------------------------------------

class LongestDimension(TorchDispatchMode):
    """The longest dimension of any tensor an operation made inside the block, backward
    included, and that tensor's shape: does any "device" ever hold the logits of more ids
    than its shard?"""

    def __init__(self) -> None:
        super().__init__()
        self.length, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.dim() and max(t.shape) > self.length:
                self.length, self.shape = max(t.shape), tuple(t.shape)
        return out


def _close(got: Tensor, want: Tensor) -> bool:
    """Equal up to float32 rounding at the scale of ``want``: with logits in the thousands a
    correct answer's gradients differ from F.cross_entropy's by ~1e-5 of their largest."""
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))


def vocab_shards(projection: nn.Linear, sizes: list[int]) -> list[nn.Linear]:
    """``projection`` (to the vocabulary) cut by vocabulary rows into shards of ``sizes``
    ids, in order: shard k holds ids ``sum(sizes[:k]) .. sum(sizes[:k + 1]) - 1``, as a
    device would."""
    if sum(sizes) != projection.out_features:
        raise ValueError(f"the shards' sizes {sizes} add up to {sum(sizes)}, not the "
                         f"projection's vocabulary of {projection.out_features}")
    shards, start = [], 0
    for size in sizes:
        shard = nn.Linear(projection.in_features, size)
        with torch.no_grad():
            shard.weight.copy_(projection.weight[start:start + size])
            shard.bias.copy_(projection.bias[start:start + size])
        shards.append(shard)
        start += size
    return shards


#: The notebook's case: shards of 23 and 27 ids, 24 tokens of width 8.
SHOWN_4_3 = ((23, 27), 24, 8)


def _vocab_case(rng: Any) -> tuple[tuple[int, ...], int, int]:
    """Shard sizes, tokens and width drawn for this run: 2 to 4 shards of 8 to 30 ids, and
    neither the tokens nor the width longer than the largest shard (so that only logits
    of more ids than a shard's can break the rule), at least 8 tokens (every shard's
    first and last id among the targets)."""
    sizes = tuple(rng.randint(8, 30) for _ in range(rng.randint(2, 4)))
    return sizes, rng.randint(8, max(sizes)), rng.randint(2, min(12, max(sizes)))


@ignores_namespace(1)
def check_4_3(vocab_parallel_cross_entropy: Callable[..., Tensor]) -> None:
    """Exercise 4.3: the loss and every gradient equal ``F.cross_entropy`` on the whole
    projection's logits, for moderate logits and for logits too large for ``exp`` in
    float32; and no tensor made, forward or backward, has a dimension longer than the
    largest shard (the whole vocabulary, for one token or for some, is longer; the tokens
    and the width are not). On the notebook's two shards of 23 and 27 ids, and on 2 to 4
    shards, tokens and a width drawn for this run."""
    for sizes, tokens, width in [SHOWN_4_3] + hidden_cases(_vocab_case, 1, shown=[SHOWN_4_3]):
        for scale, what in [(1.0, "moderate logits"), (1000.0, "logits in the thousands")]:
            _check_vocab_parallel(vocab_parallel_cross_entropy, list(sizes), tokens, width,
                                  scale, f"{len(sizes)} shards of {list(sizes)} ids, {tokens} "
                                         f"tokens of width {width}, {what}")


def _check_vocab_parallel(vocab_parallel_cross_entropy: Callable[..., Tensor],
                          sizes: list[int], tokens: int, width: int, scale: float,
                          what: str) -> None:
    vocab, largest_shard = sum(sizes), max(sizes)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    torch.manual_seed(1)
    projection = nn.Linear(width, vocab)
    with torch.no_grad():
        projection.weight.mul_(scale)
    features = torch.randn(tokens, width)
    target = torch.randint(0, vocab, (tokens,))
    edges = sorted({0, vocab - 1, *starts, *(a - 1 for a in starts[1:])})[:tokens]
    target[:len(edges)] = torch.tensor(edges)             # every shard's first and last id
    plain_in = features.clone().requires_grad_()
    expected = F.cross_entropy(projection(plain_in), target)
    expected.backward()
    mine = features.clone().requires_grad_()
    shards = vocab_shards(projection, sizes)
    longest = LongestDimension()
    with withheld(vocab_shards), longest:
        loss = vocab_parallel_cross_entropy(mine, shards, target)
        _require(isinstance(loss, Tensor) and loss.dim() == 0 and loss.requires_grad,
                 f"return the mean loss as a 0-dim tensor still attached to the graph "
                 f"(so that .backward() reaches the shards), got {loss!r}"[:300])
        loss.backward()
    _require(longest.length <= largest_shard,
             f"{what}: a tensor of shape {list(longest.shape)} was made, a "
             f"dimension of {longest.length}, longer than the largest shard's "
             f"{largest_shard} ids: the logits of more ids than one device holds (or a "
             f"shard's logits flattened). Each device may hold only its own shard's "
             f"logits, [{tokens}, its ids]; combine per-token numbers ([{tokens}] each: a "
             f"max, a sum of exponentials, the target's logit) across the devices instead")
    got = loss.item()
    _require(math.isfinite(got),
             f"{what}: your loss is {got}: exp of a logit in the thousands overflows "
             f"(float32 above about 88, float64 above about 709). Subtract each token's "
             f"largest logit over the whole vocabulary (the max of the devices' maxima) "
             f"before exp, and add it back after log")
    _require(abs(got - expected.item()) <= 1e-4 * max(1.0, abs(expected.item())),
             f"{what}: your loss is {got:.5f}, {'more' if got > expected.item() else 'less'} "
             f"than F.cross_entropy on the whole logits gives. Per token: log of the sum of "
             f"exp over the whole vocabulary (every device's sum, each taken after "
             f"subtracting the same global max) minus the target's logit, which only the "
             f"device holding that id has (at index target - that shard's first id)")
    for k, shard in enumerate(shards):
        for name in ("weight", "bias"):
            grad = getattr(shard, name).grad
            want = getattr(projection, name).grad[starts[k]:starts[k] + sizes[k]]
            _require(grad is not None and _close(grad, want),
                     f"{what}: shard {k}'s {name} gradient differs from that slice of "
                     f"the whole projection's: build the loss from every shard's logits, "
                     f"so the backward reaches each shard")
    _require(mine.grad is not None and _close(mine.grad, plain_in.grad),
             f"{what}: the gradient of the features differs from F.cross_entropy's: "
             f"every shard's logits must stay in the graph")
