"""Small workloads shared by the threaded tests and the torchrun workers: a stack of
linear layers, a skip connection's two ends, stages that pass trees to each other, and a
token model on padded batches."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline_lib import SumCount, pop, skippable, stash

ROWS, VOCAB, SEQ, PAD = 12, 11, 6, -100
CHECKPOINTS = ["always", "except_last", "never"]
BALANCES = {2: [4, 5], 3: [3, 3, 3], 4: [2, 2, 2, 3]}   # for make_model's 9 layers


def make_model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(6, 6), nn.Dropout(dropout) if dropout else nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(6, 3))


def data(rows: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Stashes its (linear) output, which thus needs a gradient from the popping stage."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        h = self.linear(x)
        yield stash("skip", h)
        return torch.tanh(h)


@skippable(pop=["skip"])
class PopMul(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) * skip


class TreeBlock(nn.Module):
    """Takes and returns a dict holding a list, a tuple, an integer tensor, None and a
    float: every kind of leaf and container that may travel between stages."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, state):
        h, (g, (ids, nothing)) = state["h"], state["aux"]
        assert nothing is None
        return {"h": torch.tanh(self.a(h)) + g, "scale": state["scale"],
                "aux": [self.b(h) * state["scale"] + ids.unsqueeze(-1), (ids + 1, None)]}


class TreeHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(6, 3)

    def forward(self, state):
        return self.out(state["h"] * state["aux"][0])


def tree_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(TreeBlock(), TreeBlock(), TreeBlock(), TreeHead())


def tree_batch():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    return {"h": x, "aux": [x.flip(1), (torch.arange(ROWS) % 3, None)], "scale": 0.5}, y


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, VOCAB))


PADDING = [0, 5, 1, 4, 5, 5, 3, 3, 0, 0, 5, 2]   # padding tokens at the end of each row


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 micro-batches of 3 rows hold 12, 4, 12 and 11 real tokens, 2 replicas 16 and 23:
    a per-micro-batch (or per-replica) mean weighs tokens unequally."""
    g = torch.Generator().manual_seed(2)
    inputs = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    for row, padding in enumerate(PADDING):
        target[row, SEQ - padding:] = PAD
    return inputs, target


def token_sum(logits, target):
    """The SumCount form: summed cross-entropy and the number of real tokens."""
    return SumCount(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD,
                                    reduction="sum"), (target != PAD).sum())


def token_mean(logits, target):
    """The unpipelined reference: the mean over every real token of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD)
