"""``torch.distributed.pipeline.sync.skip``: skip connections under their classic names.

They are `pipeline_lib.skip`'s: ``@skippable(stash=[...], pop=[...])`` on a module whose
``forward`` yields ``stash(name, tensor)`` and ``pop(name)``, ``layer.isolate(Namespace())``
for copies, and `verify_skippables` (there `verify_skips`) to check a model without
building a `Pipe`. Mismatches raise `SkipError`, which is a `TypeError` and a
`RuntimeError` as the classic API's errors were.
"""
from pipeline_lib.skip import Namespace, SkipError, pop, skippable, stash
from pipeline_lib.skip import verify_skips as verify_skippables

__all__ = ["Namespace", "SkipError", "pop", "skippable", "stash", "verify_skippables"]
