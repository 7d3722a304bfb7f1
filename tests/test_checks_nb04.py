"""Notebook 04's exercise checks, run in-process: each solution passes; each plausible
wrong answer and each library shortcut fails with its exercise's own message."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from pipeline_lib.course.checks.nb04 import check_4_1, check_4_2, check_4_3
from pipeline_lib.course.data_parallel import reduce_gradients, replicate, scatter
from pipeline_lib.course.exercises import ExerciseFailed, exercise
from pipeline_lib.lm.chunked_loss import chunked_loss_backward
from pipeline_lib.lm.multi_device_loss import multi_device_loss_backward


def fails(check, answer, says: str, name: str) -> str:
    with pytest.raises(ExerciseFailed) as failed, exercise(name):
        check(answer)
    assert str(failed.value).startswith(name) and says in str(failed.value), failed.value
    return str(failed.value)


def passes(check, answer) -> None:
    check(answer)


# -- 4.1 ----------------------------------------------------------------------------------------

E41 = "Exercise 4.1 (scatter + chunked loss)"


def scattered(features, generator, target, devices, chunk, *, denominator=None,
              use_replicas=True, do_chunks=True, do_scatter=True):
    """The solution, with switches for the usual mistakes."""
    tokens = target.numel()
    pieces = scatter(features.detach(), devices) if do_scatter else [features.detach()]
    targets = scatter(target, devices) if do_scatter else [target]
    replicas = (replicate(generator, devices[:len(pieces)]) if use_replicas
                else [generator] * len(pieces))
    total, piece_grads = 0.0, []
    for piece, replica, piece_target in zip(pieces, replicas, targets):
        step = chunk if do_chunks else piece.size(1)
        grads = []
        for a in range(0, piece.size(1), step):
            column = piece[:, a:a + step].detach().requires_grad_()
            part = F.cross_entropy(replica(column).flatten(0, 1),
                                   piece_target[:, a:a + step].flatten(), reduction="sum")
            part = part / (denominator(piece_target[:, a:a + step], pieces) if denominator
                           else tokens)
            part.backward()
            total += part.item()
            grads.append(column.grad)
        piece_grads.append(torch.cat(grads, dim=1))
    features.backward(torch.cat(piece_grads))
    if use_replicas:
        reduce_gradients(replicas, generator)
    return total


def summed_then_backward(features, generator, target, devices, chunk):
    """Chunks projected one by one, but their losses summed and backpropagated once: every
    chunk's logits stay alive until the end, so the chunks save no memory."""
    tokens = target.numel()
    pieces = [p.detach().requires_grad_() for p in scatter(features.detach(), devices)]
    replicas = replicate(generator, devices[:len(pieces)])
    total = 0
    for piece, replica, t in zip(pieces, replicas, scatter(target, devices)):
        for a in range(0, piece.size(1), chunk):
            total = total + F.cross_entropy(replica(piece[:, a:a + chunk]).flatten(0, 1),
                                            t[:, a:a + chunk].flatten(), reduction="sum") / tokens
    total.backward()
    features.backward(torch.cat([p.grad for p in pieces]))
    reduce_gradients(replicas, generator)
    return total.item()


def through_the_body_per_chunk(features, generator, target, devices, chunk):
    """Nothing cut off the graph: each chunk's backward runs through the body again."""
    tokens = target.numel()
    replicas = replicate(generator, devices)
    total = 0.0
    for piece, replica, t in zip(scatter(features, devices), replicas, scatter(target, devices)):
        for a in range(0, piece.size(1), chunk):
            part = F.cross_entropy(replica(piece[:, a:a + chunk]).flatten(0, 1),
                                   t[:, a:a + chunk].flatten(), reduction="sum") / tokens
            part.backward()
            total += part.item()
    reduce_gradients(replicas, generator)
    return total


def plain_loss(features, generator, target, devices, chunk):
    loss = F.cross_entropy(generator(features).flatten(0, 1), target.flatten())
    loss.backward()
    return loss.item()


def test_4_1_solution_passes():
    passes(check_4_1, scattered)


@pytest.mark.parametrize("answer, says", [
    (plain_loss, "the generator itself was called"),
    (lambda *a: scattered(*a, do_chunks=False), "at most"),
    (lambda *a: scattered(*a, do_scatter=False, use_replicas=False), "the generator itself"),
    (lambda *a: scattered(*a, use_replicas=False), "the generator itself was called"),
    (lambda *a: scattered(*a, denominator=lambda t, pieces: t.numel() * len(pieces)),
     "your loss is"),
    (lambda *a: scattered(*a, denominator=lambda t, pieces: t.numel()), "your loss is"),
    (summed_then_backward, "backpropagate each chunk's loss before projecting the next"),
    (through_the_body_per_chunk, "the backward ran 6 times through the body"),
], ids=["plain loss", "no chunks", "no scatter", "no replicas", "each chunk's mean",
        "chunk sums over own tokens", "one backward for all chunks", "body backward per chunk"])
def test_4_1_wrong_answers_fail(answer, says):
    fails(check_4_1, answer, says, E41)


def replica_gradients_left_there(features, generator, target, devices, chunk):
    """Right loss and feature gradients; the replicas' weight gradients never summed back."""
    tokens = target.numel()
    pieces, targets = scatter(features.detach(), devices), scatter(target, devices)
    replicas = replicate(generator, devices[:len(pieces)])
    total, grads = 0.0, []
    for piece, replica, t in zip(pieces, replicas, targets):
        columns = []
        for a in range(0, piece.size(1), chunk):
            column = piece[:, a:a + chunk].detach().requires_grad_()
            part = F.cross_entropy(replica(column).flatten(0, 1), t[:, a:a + chunk].flatten(),
                                   reduction="sum") / tokens
            part.backward()
            total += part.item()
            columns.append(column.grad)
        grads.append(torch.cat(columns, dim=1))
    features.backward(torch.cat(grads))
    return total


def reduced_twice(features, generator, target, devices, chunk):
    total = scattered(features, generator, target, devices, chunk)
    for p in generator.parameters():
        p.grad = 2 * p.grad
    return total


def loss_as_a_list(features, generator, target, devices, chunk):
    return [scattered(features, generator, target, devices, chunk)]


@pytest.mark.parametrize("answer, says", [
    (replica_gradients_left_there, "generator.weight.grad is None"),
    (reduced_twice, "summed into the generator, once"),
    (loss_as_a_list, "return the loss as a number"),
])
def test_4_1_more_wrong_answers_fail(answer, says):
    fails(check_4_1, answer, says, E41)


@pytest.mark.parametrize("shortcut", [
    lambda f, g, t, d, c: chunked_loss_backward(f, g, t, c).item(),
    lambda f, g, t, d, c: multi_device_loss_backward(f, g, t, d, c).item(),
    lambda f, g, t, d, c, _loss=multi_device_loss_backward: _loss(f, g, t, d, c).item(),
], ids=["chunked_loss_backward", "multi_device_loss_backward", "bound as a default"])
def test_4_1_library_shortcuts_fail(shortcut):
    fails(check_4_1, shortcut, "computes the very answer", E41)


# -- 4.2 ----------------------------------------------------------------------------------------

E42 = "Exercise 4.2 (DDP's gradient averaging)"


def averaged(replicas, *, divide=True, copies=True, only_first=False):
    for params in zip(*(r.parameters() for r in replicas)):
        total = torch.stack([p.grad for p in params]).sum(0)
        mean = total / len(params) if divide else total
        for p in params[:1] if only_first else params:
            p.grad = mean.clone() if copies else mean


def test_4_2_solution_passes():
    passes(check_4_2, averaged)


@pytest.mark.parametrize("answer, says", [
    (lambda r: averaged(r, divide=False), "averaged (divided by 3), not summed"),
    (lambda r: averaged(r, copies=False), "share one gradient tensor"),
    (lambda r: averaged(r, only_first=True), "end with a different gradient"),
    (lambda r: None, "end with a different gradient"),
], ids=["sum", "shared tensor", "first replica only", "nothing"])
def test_4_2_wrong_answers_fail(answer, says):
    fails(check_4_2, answer, says, E42)


def test_4_2_library_shortcut_fails():
    def via_reduce(replicas):
        target = copy.deepcopy(replicas[0])
        target.zero_grad(set_to_none=True)
        reduce_gradients(replicas, target)
        for r in replicas:
            for p, q in zip(r.parameters(), target.parameters()):
                p.grad = q.grad / len(replicas)
    fails(check_4_2, via_reduce, "computes the very answer", E42)

    def captured(replicas, _reduce=reduce_gradients):
        target = copy.deepcopy(replicas[0])
        _reduce(replicas, target)
    fails(check_4_2, captured, "computes the very answer", E42)


def divided_by_three(replicas):               # right for the notebook's 3 replicas only
    for params in zip(*(r.parameters() for r in replicas)):
        mean = torch.stack([p.grad for p in params]).sum(0) / 3
        for p in params:
            p.grad = mean.clone()


def replica_zero_kept(replicas):               # the others get replica 0's own gradient
    for params in zip(*(r.parameters() for r in replicas)):
        for p in params[1:]:
            p.grad = params[0].grad.clone()


def mean_without_the_last(replicas):           # range(len - 1): one replica left out
    for params in zip(*(r.parameters() for r in replicas)):
        mean = torch.stack([p.grad for p in params[:-1]]).mean(0)
        for p in params:
            p.grad = mean.clone()


@pytest.mark.parametrize("answer, says", [
    (divided_by_three, "times one model's"),
    (replica_zero_kept, "times one model's"),
    (mean_without_the_last, "times one model's"),
])
def test_4_2_more_wrong_answers_fail(answer, says):
    fails(check_4_2, answer, says, E42)


# -- 4.3 ----------------------------------------------------------------------------------------

E43 = "Exercise 4.3 (vocabulary-parallel cross-entropy)"


def target_logits(logits, target, off_by=0):
    """Each token's target logit, from the one shard that holds its id (``off_by``: ids
    taken as belonging to the shard that starts ``off_by`` later, an edge bug)."""
    picked, start = torch.zeros(len(target)), 0
    for part in logits:
        inside = (target >= start + off_by) & (target < start + part.size(1) + off_by)
        local = (target - start - off_by).clamp(0, part.size(1) - 1)
        picked = picked + torch.where(inside, part.gather(1, local[:, None])[:, 0], 0.0)
        start += part.size(1)
    return picked


def vocab_parallel(features, shards, target):
    """The solution: per-token max, sum of exps and target logit, combined over shards."""
    logits = [shard(features) for shard in shards]
    top = torch.stack([part.detach().amax(dim=1) for part in logits]).amax(dim=0)
    sum_exp = sum((part - top[:, None]).exp().sum(dim=1) for part in logits)
    picked = target_logits(logits, target)
    return (sum_exp.log() + top - picked).mean()


def whole_logits(features, shards, target):
    return F.cross_entropy(torch.cat([s(features) for s in shards], dim=1), target)


def no_max(features, shards, target):
    logits = [shard(features) for shard in shards]
    sum_exp = sum(part.exp().sum(dim=1) for part in logits)
    picked = target_logits(logits, target)
    return (sum_exp.log() - picked).mean()


def local_maxima(features, shards, target):
    """Each shard subtracts its own max and the sums are added as if it were one."""
    logits = [shard(features) for shard in shards]
    tops = [part.detach().amax(dim=1) for part in logits]
    sum_exp = sum((part - top[:, None]).exp().sum(dim=1) for part, top in zip(logits, tops))
    top = torch.stack(tops).amax(dim=0)
    picked = target_logits(logits, target)
    return (sum_exp.log() + top - picked).mean()


def local_softmax(features, shards, target):
    """Each device's own cross-entropy over its half of the vocabulary."""
    total, start = 0.0, 0
    for shard in shards:
        part = shard(features).log_softmax(dim=1)
        inside = (target >= start) & (target < start + part.size(1))
        local = (target - start).clamp(0, part.size(1) - 1)
        total = total - torch.where(inside, part.gather(1, local[:, None])[:, 0], 0.0).sum()
        start += part.size(1)
    return total / len(target)


def no_offset(features, shards, target):
    """The target's logit picked at the global id in every shard that is long enough."""
    logits = [shard(features) for shard in shards]
    top = torch.stack([part.detach().amax(dim=1) for part in logits]).amax(dim=0)
    sum_exp = sum((part - top[:, None]).exp().sum(dim=1) for part in logits)
    picked = torch.zeros_like(top)
    for part in logits:
        inside = target < part.size(1)
        local = target.clamp(0, part.size(1) - 1)
        picked = picked + torch.where(inside, part.gather(1, local[:, None])[:, 0], 0.0)
    return (sum_exp.log() + top - picked).mean()


def logsumexp_of_logsumexps(features, shards, target):
    """Also right: each device's logsumexp, combined by a logsumexp over the devices."""
    logits = [shard(features) for shard in shards]
    total = torch.stack([part.logsumexp(dim=1) for part in logits]).logsumexp(dim=0)
    picked = target_logits(logits, target)
    return (total - picked).mean()


def float64_without_max(features, shards, target):
    """No shift, but in float64: exp still overflows past about 709."""
    logits = [shard(features).double() for shard in shards]
    sum_exp = sum(part.exp().sum(dim=1) for part in logits)
    picked = target_logits(logits, target)
    return (sum_exp.log() - picked).mean().float()


@pytest.mark.parametrize("answer", [vocab_parallel, logsumexp_of_logsumexps],
                         ids=["solution", "logsumexp of logsumexps"])
def test_4_3_solution_passes(answer):
    passes(check_4_3, answer)


@pytest.mark.parametrize("answer, says", [
    (whole_logits, "longer than the largest shard"),
    (no_max, "overflows"),
    (local_maxima, "your loss is"),
    (local_softmax, "your loss is"),
    (no_offset, "your loss is"),
    (float64_without_max, "overflows"),
], ids=["whole logits", "no max", "local maxima", "local softmax", "no offset",
        "float64 without max"])
def test_4_3_wrong_answers_fail(answer, says):
    fails(check_4_3, answer, says, E43)


def first_id_missed(features, shards, target):
    """A shard's first id counted as the previous shard's (> instead of >=)."""
    logits = [shard(features) for shard in shards]
    top = torch.stack([part.detach().amax(dim=1) for part in logits]).amax(dim=0)
    sum_exp = sum((part - top[:, None]).exp().sum(dim=1) for part in logits)
    return (sum_exp.log() + top - target_logits(logits, target, off_by=1)).mean()


def first_shard_max(features, shards, target):
    """The shift taken from the first shard's logits only."""
    logits = [shard(features) for shard in shards]
    top = logits[0].detach().amax(dim=1)
    sum_exp = sum((part - top[:, None]).exp().sum(dim=1) for part in logits)
    picked = target_logits(logits, target)
    return (sum_exp.log() + top - picked).mean()


def summed_over_tokens(features, shards, target):
    return vocab_parallel(features, shards, target) * len(target)


def whole_vocabulary_half_the_tokens_at_a_time(features, shards, target):
    """The whole vocabulary's logits of half the tokens at a time: no [N, V] tensor, but
    rows of all V logits all the same."""
    half = len(target) // 2
    return sum(F.cross_entropy(torch.cat([s(features[a:b]) for s in shards], dim=1),
                               target[a:b], reduction="sum")
               for a, b in [(0, half), (half, len(target))]) / len(target)


def whole_vocabulary_token_by_token(features, shards, target):
    return torch.stack([F.cross_entropy(torch.cat([s(features[k:k + 1]) for s in shards],
                                                  dim=1), target[k:k + 1])
                        for k in range(len(target))]).mean()


def flattened_shards(features, shards, target):
    """Each shard's logits flattened, [N * V_k], to take a max over one dimension."""
    logits = [shard(features) for shard in shards]
    flat = [part.flatten() for part in logits]
    top = torch.stack([f.view(len(target), -1).detach().amax(dim=1) for f in flat]).amax(0)
    sum_exp = sum((part - top[:, None]).exp().sum(dim=1) for part in logits)
    return (sum_exp.log() + top - target_logits(logits, target)).mean()


@pytest.mark.parametrize("answer", [whole_vocabulary_half_the_tokens_at_a_time,
                                    whole_vocabulary_token_by_token, flattened_shards])
def test_4_3_logits_of_more_ids_than_a_shard_fail(answer):
    """The rule is per dimension, not per tensor size: a row of all V logits breaks it."""
    fails(check_4_3, answer, "longer than the largest shard", E43)


def vocab_parallel_ids_first(features, shards, target):
    """Right, written otherwise: each shard's logits as [V_k, N], ids along dim 0."""
    logits = [shard.weight @ features.T + shard.bias[:, None] for shard in shards]
    top = torch.stack([part.detach().amax(dim=0) for part in logits]).amax(dim=0)
    total = sum((part - top).exp().sum(dim=0) for part in logits)
    picked = target_logits([part.T for part in logits], target)
    return (total.log() + top - picked).mean()


def test_4_3_right_answer_written_another_way_passes():
    passes(check_4_3, vocab_parallel_ids_first)


@pytest.mark.parametrize("answer, says", [
    (first_id_missed, "your loss is"),
    (first_shard_max, "overflows"),
    (summed_over_tokens, "your loss is"),
])
def test_4_3_more_wrong_answers_fail(answer, says):
    fails(check_4_3, answer, says, E43)
