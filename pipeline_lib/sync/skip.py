"""``torch.distributed.pipeline.sync.skip``: skip connections under their classic names.

They are `pipeline_lib.skip`'s: ``@skippable(stash=[...], pop=[...])`` on a module whose
``forward`` yields ``stash(name, tensor)`` and ``pop(name)``, ``layer.isolate(Namespace())``
for copies, and `verify_skippables` to check a model without building a `Pipe`.
Mismatches raise `SkipError`, which is a `TypeError` and a `RuntimeError` as the classic
API's errors were.

One classic rule differs from `pipeline_lib.skip`: a layer declaring a name both to stash
and to pop is accepted by the decorator and refused by `verify_skippables` (so by `Pipe`),
where `pipeline_lib.skippable` refuses it at once.
"""
from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

from pipeline_lib import skip
from pipeline_lib.skip import Namespace, SkipError, SkipKey, Skippable, pop, stash

__all__ = ["Namespace", "SkipError", "pop", "skippable", "stash", "verify_skippables"]


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()
              ) -> Callable[[type[nn.Module]], type[Skippable]]:
    """`pipeline_lib.skippable`, except that a name may be declared in both lists, as the
    classic decorator allowed; `verify_skippables` refuses such a layer."""
    if isinstance(stash, str) or isinstance(pop, str):
        return skip.skippable(stash, pop)      # refused there, with its message
    stashes, pops = tuple(stash), tuple(pop)
    decorate = skip.skippable(stashes, [name for name in pops if name not in stashes])

    def classic(cls: type[nn.Module]) -> type[Skippable]:
        made = decorate(cls)
        made.pops = pops
        return made
    return classic


def verify_skippables(module: nn.Sequential) -> dict[SkipKey, tuple[int, int]]:
    """`pipeline_lib.verify_skips`, first refusing a layer that declares a name both to
    stash and to pop, with the classic checker's message ("'0' declared 'foo' both as
    stashable and as poppable", naming the layer by its path in ``module``)."""
    problems = []
    for name, layer in module.named_children():
        for path, sub in layer.named_modules(prefix=name):
            if isinstance(sub, Skippable):
                for both in sorted(set(sub.stashes) & set(sub.pops)):
                    problems.append(f"'{path}' declared '{both}' both as stashable and "
                                    f"as poppable ({type(sub).__name__}); a layer cannot "
                                    f"pop what it stashes: split it in two layers")
    if problems:
        raise SkipError("skip connections do not pair up:\n  " + "\n  ".join(problems))
    return skip.verify_skips(module)
