"""`Pipe` keeps freed memory for CPU stages, once per process, unless told not to."""
import subprocess
import sys
import textwrap

import pytest
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.threaded import allocator


@pytest.fixture
def mallopt(monkeypatch):
    """A recording stand-in for glibc's mallopt, in a process that has not applied it."""
    calls = []

    def fake(option: int, value: int) -> int:
        calls.append((option, value))
        return 1

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: fake)
    monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    return calls


def two_stages(**kwargs) -> Pipe:
    return Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2, **kwargs)


def test_a_cpu_pipe_applies_every_setting_once_per_process(mallopt):
    two_stages()
    assert mallopt == list(allocator.SETTINGS)
    two_stages()
    assert mallopt == list(allocator.SETTINGS)      # not again
    assert allocator.keep_freed_memory()


def test_the_constructor_opts_out(mallopt):
    two_stages(keep_freed_memory=False)
    assert mallopt == []
    assert not allocator.for_stages(["cpu"], keep=False)


@pytest.mark.parametrize("value, applied", [("0", False), ("1", True), (" 1 ", True)])
def test_the_environment_opts_out(mallopt, monkeypatch, value, applied):
    monkeypatch.setenv(allocator.ENV_VAR, value)
    two_stages()
    assert mallopt == (list(allocator.SETTINGS) if applied else [])


def test_an_unclear_environment_value_is_refused(mallopt, monkeypatch):
    monkeypatch.setenv(allocator.ENV_VAR, "no")
    with pytest.raises(ValueError, match=f"{allocator.ENV_VAR} must be 1 .* or 0"):
        two_stages()
    assert mallopt == []


def test_only_cpu_stages_ask_for_it(mallopt):
    assert not allocator.for_stages(["cuda:0", "meta"])
    assert mallopt == []


def test_without_glibc_nothing_happens(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    two_stages()
    assert allocator.keep_freed_memory() is False


def test_a_setting_glibc_refuses_is_reported(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda option, value: option != -8)
    assert allocator.keep_freed_memory() is False


# What the setting does, in a fresh process: a step's activations held together, then freed.
# By default glibc maps a block above 32 MiB (its largest mmap threshold) afresh each time,
# and the kernel faults all its pages in again; kept, it comes from the heap's free memory.
SIZES_MIB = [1, 2, 40, 8]
FAULTS = textwrap.dedent(f"""
    import resource, torch
    from torch import nn
    from pipeline_lib import Pipe
    Pipe(nn.Sequential(nn.Linear(2, 2)))
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def step():
        activations = [torch.ones(mib << 18) for mib in {SIZES_MIB}]   # float32, written
    for _ in range(6):
        step()
    before = faults()
    for _ in range(5):
        step()
    print(faults() - before)
""")


@pytest.mark.skipif(allocator._mallopt() is None, reason="needs glibc")
def test_a_pipe_stops_steps_faulting_their_memory_in_again():
    def faults(keep: str) -> int:
        env = {"PYTHONPATH": ":".join(sys.path), allocator.ENV_VAR: keep}
        run = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True,
                             text=True, check=True, timeout=120)
        return int(run.stdout.split()[-1])

    kept, default = faults("1"), faults("0")
    pages = 5 * sum(SIZES_MIB) * 256         # 4 KiB pages
    assert kept < pages // 100, (kept, default)
    assert default > 10 * max(kept, 1), (kept, default)
