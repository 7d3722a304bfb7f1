"""The package metadata claims no older Python or torch than the code runs on."""
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def lower_bound(spec: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def test_python_bound_covers_the_features_the_code_uses():
    """``BaseException.add_note`` is Python 3.11's: a 3.10 install would fail on an
    error path, the worst moment."""
    uses_add_note = any(".add_note(" in path.read_text()
                        for path in (REPO / "pipeline_lib").rglob("*.py"))
    assert uses_add_note
    assert lower_bound(PROJECT["requires-python"]) >= (3, 11)


def test_torch_bound_is_the_release_the_suite_pins():
    """The notebooks use 2.13's private schedule visualiser; the suite is tested on the
    torch that requirements.txt pins, and claims no older one."""
    pinned = re.search(r"^torch==(\d+)\.(\d+)", (REPO / "requirements.txt").read_text(),
                       flags=re.MULTILINE)
    torch_spec = next(d for d in PROJECT["dependencies"] if d.startswith("torch"))
    assert lower_bound(torch_spec)[:2] == (int(pinned[1]), int(pinned[2]))
