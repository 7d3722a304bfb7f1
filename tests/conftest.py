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
