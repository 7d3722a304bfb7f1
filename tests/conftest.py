"""Shared test fixtures: where the CI-sized WikiText-2 copy lies."""
import os
from pathlib import Path

import pytest

MINI = Path(os.environ.get("PIPELINE_LIB_DATA")
            or Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-mini")
needs_mini = pytest.mark.skipif(
    not (MINI / "train.txt").is_file(),
    reason=f"WikiText-2 mini copy not found at {MINI}; set PIPELINE_LIB_DATA to a folder "
           "with train.txt, valid.txt and test.txt")


def assert_same_grads(model, reference, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every parameter of ``model`` got the gradient its twin in ``reference`` got."""
    import torch

    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
