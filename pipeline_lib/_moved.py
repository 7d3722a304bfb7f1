"""Old module paths that still import, with a `DeprecationWarning`, for one release.

The modules that serve the notebooks rather than a pipeline moved into
`pipeline_lib.course`; code written against the old paths (a learner's copy of a
notebook, a script) keeps working and is told the new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "pipeline_lib.exercises": "pipeline_lib.course.exercises",
    "pipeline_lib.speed": "pipeline_lib.course.speed",
    "pipeline_lib.data_parallel": "pipeline_lib.course.data_parallel",
    "pipeline_lib.pytorch_schedules": "pipeline_lib.course.pytorch_schedules",
    "pipeline_lib.notebook_workers": "pipeline_lib.course.workers",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path (or a module below it) as the module at its new path."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if self._new_name(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self._new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path "
                      f"goes in the next release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        sys.modules[spec.name] = module
        spec.loader_state = module.__spec__   # the import system overwrites it: see below
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed. The import system has just set
        its ``__spec__`` to the old path's, which names no package location: put its own
        back, or ``importlib.resources.files`` would call the package "not a package"."""
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name: str):
        """For ``python -m old.path`` (runpy runs the new module's code as ``__main__``)."""
        new = self._new_name(name)
        return importlib.util.find_spec(new).loader.get_code(new)

    @staticmethod
    def _new_name(name: str) -> str | None:
        for old, new in MOVED.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return None


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())   # before the path finder, which would load a
        # module below an old package path a second time, under its old name
