"""`make gpu-check`: what a first run on GPUs must get right, checked in one script.

    PYTHONPATH=. python3 bench/gpu_check.py          # a GPU machine (1 GPU or more)
    PYTHONPATH=. python3 bench/gpu_check.py --cpu    # every row on CPUs and gloo instead

Each row is one property, checked where this machine can (one GPU: stage threads share
it; two ranks share it where NCCL allows, else one NCCL rank); a row that needs more GPUs
than there are says "skip: 1 GPU". The rows, by area:

* env: torch, CUDA, NCCL and the GPUs found; every module of the library imports;
* pytest: each test of tests/test_gpu.py and tests/test_gpu_real_run.py;
* Pipe: every schedule's gradients on stage threads against the unpipelined model on
  the same device; dropout replayed by checkpointed stages; bfloat16 autocast; the
  whole model's gradient norm clipped; no synchronising call in a steady-state step
  (``torch.cuda.set_sync_debug_mode("error")``);
* DistributedPipe over NCCL: every schedule's gradients against one process; dropout
  masks equal to the threaded Pipe's; clipping; no synchronising call in a steady-state
  step; each rank says at start where it computes (`launch.announce`);
* lm.train: a bf16, clipped run on the GPU saves after step 3 and resumes to step 5,
  logging what an uninterrupted run logs; its log names the device that timed the layers;
* speed: `Pipe.step` on 2 GPUs against p·m/(m+p−1) (on 1 GPU: its cost against the
  plain step, where no speedup is possible).

The torchrun jobs run beside the in-process rows; the whole takes 2-3 minutes on a GPU
machine. Prints a line per row as it ends and the table last; writes ``gpu_check.json``
(every row) and ``gpu_check.log`` (the output of every job and of pytest) to ``$OUT``
when set, else to ``out/``. Exits 1 if a row failed. ``--cpu`` runs every row on the CPU
over gloo (the rows that need CUDA skip): how the script itself is tested
(tests/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests"), str(REPO)]
TUTORIAL_VOCAB = 28_782   # WikiText-2's, as in the tutorial: ~1.4 billion parameters
JOB_TIMEOUT = 150         # seconds: a job past it is killed, its row fails
# what a pytest test checks, by a word of its name (the first that matches)
AREAS = (("nccl", "NCCL"), ("bf16", "bf16"), ("clip", "clipping"), ("resume", "resume"),
         ("training_program", "lm.train"))


class Skip(Exception):
    """A row that this machine cannot check, and why."""


@dataclass
class Row:
    area: str
    check: str
    result: str = "pass"   # pass, FAIL, skip, info
    detail: str = ""
    seconds: float = 0.0


class Table:
    """The rows, each printed as it ends; a row's exception is its failure."""

    def __init__(self, log: io.TextIOBase):
        self.rows: list[Row] = []
        self.log = log
        self.speed: list[dict] = []   # the speed rows' numbers, for the JSON file

    @contextlib.contextmanager
    def row(self, area: str, check: str) -> Iterator[Row]:
        row, start = Row(area, check), time.perf_counter()
        try:
            yield row
        except Skip as why:
            row.result, row.detail = "skip", str(why)
        except Exception as exc:  # noqa: BLE001 - a failed row, reported; the others go on
            row.result = "FAIL"
            row.detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            self.log.write(f"\n== {area}: {check} failed\n{traceback.format_exc()}")
        row.seconds = time.perf_counter() - start
        self.rows.append(row)
        print(f"{row.result:4} | {area} | {check}" + (f" | {row.detail}" if row.detail else ""),
              flush=True)

    def add(self, area: str, check: str, result: str, detail: str = "") -> None:
        with self.row(area, check) as row:
            row.result, row.detail = result, detail

    def print(self) -> None:
        print(f"\n{'result':6} {'area':15} {'seconds':>7}  check (detail)")
        for row in self.rows:
            detail = f"  ({row.detail[:110]})" if row.detail else ""
            print(f"{row.result:6} {row.area:15} {row.seconds:7.1f}  {row.check}{detail}")
        counts = {r: sum(row.result == r for row in self.rows) for r in ("pass", "FAIL", "skip",
                                                                         "info")}
        print("  " + ", ".join(f"{n} {r}" for r, n in counts.items()))


# -- the machine -------------------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    """What the rows run on: ``gpus`` CUDA devices (0 with ``--cpu``)."""

    gpus: int

    @property
    def cuda(self) -> bool:
        return self.gpus > 0

    def device(self, rank: int = 0) -> torch.device:
        """Rank ``rank``'s device: its own GPU where there are enough, else GPU 0 (or the
        CPU) shared."""
        if not self.cuda:
            return torch.device("cpu")
        return torch.device("cuda", rank if rank < self.gpus else 0)

    def needs(self, gpus: int) -> None:
        if self.gpus < gpus:
            raise Skip(f"{self.gpus} GPU" if self.cuda else "no GPU")


# -- torchrun jobs, run beside the in-process rows ----------------------------------------

class Job:
    """A torchrun job started now, waited for later; ``out``: a folder for its results."""

    def __init__(self, name: str, nproc: int, args: list[Any], env: dict[str, str] | None = None,
                 out: Path | None = None):
        self.name, self.started, self.out = name, time.monotonic(), out
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", *map(str, args)]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                       "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                        env=environment, start_new_session=True)
        self.output: str | None = None

    def wait(self, log: io.TextIOBase) -> str:
        """The job's output; raises if it failed or ran past `JOB_TIMEOUT`."""
        if self.output is None:
            from pipeline_lib.distributed.launch import kill_job

            left = max(1.0, JOB_TIMEOUT - (time.monotonic() - self.started))
            try:
                self.output = self.process.communicate(timeout=left)[0]
            except subprocess.TimeoutExpired:
                self.output = kill_job(self.process) + f"\n[killed after {JOB_TIMEOUT} s]"
            log.write(f"\n== job {self.name} (exit {self.process.returncode})\n{self.output}")
        if self.process.returncode != 0:
            raise RuntimeError(f"job {self.name} exited with {self.process.returncode}: "
                               f"{_last_error(self.output)}")
        return self.output


def _last_error(output: str) -> str:
    """The line of a job's output that says what went wrong, or its last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    said = [line for line in lines if re.search(r"Error|error:|refuse|Duplicate|failed", line)]
    return (said or lines or ["no output"])[-1].strip()[:300]


# -- the rows ------------------------------------------------------------------------------

def environment(table: Table, machine: Machine) -> None:
    with table.row("env", "torch, CUDA, NCCL and the GPUs found") as row:
        row.result = "info"
        names = sorted({torch.cuda.get_device_name(k) for k in range(machine.gpus)})
        nccl = torch.cuda.nccl.version() if machine.cuda else "-"
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        row.detail = (f"torch {torch.__version__}, Python {platform.python_version()}, "
                      f"CUDA {torch.version.cuda}, NCCL {nccl}, {machine.gpus} GPU(s) "
                      f"{names or ''}")
    with table.row("env", "every module of pipeline_lib imports on this torch") as row:
        import pkgutil

        import pipeline_lib

        missing = set()
        for module in pkgutil.walk_packages(pipeline_lib.__path__, "pipeline_lib."):
            try:
                __import__(module.name)
            except ModuleNotFoundError as exc:   # a package this machine lacks, not torch
                if (exc.name or "").split(".")[0] in ("torch", "pipeline_lib"):
                    raise
                missing.add(exc.name)
        row.detail = f"not installed here: {sorted(missing)}" if missing else ""


def pytest_rows(table: Table, log: io.TextIOBase) -> None:
    """Each test of the GPU test files, as a row (skipped ones with pytest's reason)."""
    import pytest

    class Results:
        def __init__(self) -> None:
            self.outcomes: dict[str, tuple[str, str]] = {}

        def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
            if report.failed:
                self.outcomes[report.nodeid] = ("FAIL", f"in {report.when}: " + str(
                    report.longrepr).splitlines()[-1][:200])
            elif report.skipped:
                self.outcomes[report.nodeid] = ("skip", str(report.longrepr[2]).removeprefix(
                    "Skipped: "))
            elif report.when == "call":
                self.outcomes[report.nodeid] = ("pass", "")

    results = Results()
    with contextlib.redirect_stdout(log):
        pytest.main([str(REPO / "tests" / name) for name in ("test_gpu.py", "test_gpu_real_run.py")]
                    + ["-q", "-p", "no:cacheprovider", "--no-header"], plugins=[results])
    for nodeid, (outcome, why) in results.outcomes.items():
        test = nodeid.split("::")[-1]
        table.add("pytest " + next((name for word, name in AREAS if word in test), "GPU"),
                  test, outcome, why)
    if not results.outcomes:
        table.add("pytest", "tests/test_gpu*.py", "FAIL", "pytest ran no test: see the log")


def even(layers: int, stages: int) -> list[int]:
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def assert_grads(pipe: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    """``pipe``'s gradients are ``want``'s, the unpipelined model's by name (a Pipe holds
    the model's parameters in its order, under names of its own)."""
    params = list(pipe.parameters())
    assert len(params) == len(want), f"{len(params)} parameters, expected {len(want)}"
    for (name, grad), p in zip(want.items(), params):
        torch.testing.assert_close(p.grad, grad.to(p.grad.device), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def threaded_pipe(machine: Machine, schedule: str, dropout: float = 0.0,
                  checkpoint: str = "except_last", ranks: int = 2, microbatches: int = 4) -> Any:
    """`dist_worker.tiny_lm` on ``ranks`` stage threads, each on its rank's device."""
    from dist_worker import tiny_lm
    from pipeline_lib import Pipe
    from pipeline_lib.schedules import plan, stages_per_rank

    stages = ranks * stages_per_rank(schedule)
    rank_of = plan(schedule, ranks, stages, microbatches).rank_of
    return Pipe(tiny_lm(dropout), microbatches, checkpoint, even(8, stages),
                [machine.device(rank_of(s)) for s in range(stages)])


def reference(device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from dist_worker import batch, tiny_lm, token_loss

    model = tiny_lm().to(device)
    loss = token_loss(model(batch()[0].to(device)), batch()[1].to(device))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def pipe_rows(table: Table, machine: Machine) -> None:
    from dist_worker import batch, token_loss
    from pipeline_lib.grad_clip import clip_grad_norm_
    from pipeline_lib.schedules import BUILDERS

    where = "2 stage threads on one GPU" if machine.gpus == 1 else (
        "2 GPUs" if machine.cuda else "2 stage threads on the CPU")
    want_loss, want = reference(machine.device())
    with table.row("Pipe", f"every schedule's gradients = the unpipelined model's "
                           f"({where})") as row:
        failed = []
        for schedule in sorted(BUILDERS):
            pipe = threaded_pipe(machine, schedule)
            loss = pipe.step(*batch(), token_loss, schedule)
            try:
                torch.testing.assert_close(loss, want_loss.to(loss.device), rtol=1e-4, atol=1e-5)
                assert_grads(pipe, want)
            except AssertionError as exc:
                failed.append(f"{schedule}: {str(exc).splitlines()[0]}")
        if failed:
            raise AssertionError("; ".join(failed))
        row.detail = f"{len(BUILDERS)} schedules"
    with table.row("Pipe", f"dropout replayed by checkpointed stages ({where})"):
        grads = []
        for checkpoint in ("never", "always"):
            pipe = threaded_pipe(machine, "1f1b", dropout=0.5, checkpoint=checkpoint)
            torch.manual_seed(123)
            pipe.step(*batch(), token_loss, "1f1b")
            grads.append({n: p.grad for n, p in pipe.named_parameters()})
        for name, grad in grads[0].items():
            torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with table.row("Pipe", f"bfloat16 autocast: float32 weights, the plain model's loss "
                           f"({where})") as row:
        from dist_worker import tiny_lm

        device = machine.device()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            expected = token_loss(tiny_lm().to(device)(batch()[0].to(device)),
                                  batch()[1].to(device)).float()
            pipe = threaded_pipe(machine, "1f1b")
            loss = pipe.step(*batch(), token_loss, "1f1b")
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                   for p in pipe.parameters())
        torch.testing.assert_close(loss.float(), expected.to(loss.device), rtol=1e-2, atol=1e-2)
        row.detail = f"loss {loss.item():.4f}, unpipelined {expected.item():.4f}"
    with table.row("Pipe", f"clip_grad_norm_ over the stages = PyTorch's on the whole "
                           f"model ({where})"):
        from dist_worker import tiny_lm

        pipe = threaded_pipe(machine, "zb_h1")
        pipe.step(*batch(), token_loss, "zb_h1")
        norm = clip_grad_norm_(pipe, 0.05).item()
        model = tiny_lm().to(machine.device())
        inputs, target = (t.to(machine.device()) for t in batch())
        token_loss(model(inputs), target).backward()
        expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
        assert abs(norm - expected) <= 1e-4 * expected, (norm, expected)
        assert_grads(pipe, {n: p.grad for n, p in model.named_parameters()})
    with table.row("Pipe", f"a steady-state step makes the host wait for nothing ({where})") as row:
        import torch.nn.functional as F
        from gpu_check_worker import mlp, mlp_batch
        from pipeline_lib import Pipe

        pipes = {m: Pipe(mlp(), m, "except_last", [2, 2], [machine.device(0), machine.device(1)])
                 for m in (2, 4)}
        row.detail = no_host_waits(machine, {m: (lambda pipe=pipe: pipe.step(
            *mlp_batch(), F.cross_entropy, "1f1b")) for m, pipe in pipes.items()})


def no_host_waits(machine: Machine, steps: dict[int, Callable[[], Any]]) -> str:
    """``steps[m]``: a step at m micro-batches. Each runs once, then, on a GPU, twice
    under ``set_sync_debug_mode("error")``; on the CPU, once counted by
    `host_sync.HostSyncs`, whose sites must not depend on m (nothing per micro-batch or
    per message)."""
    for step in steps.values():
        step()
    if machine.cuda:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in steps.values():
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return f"m = {sorted(steps)} under torch.cuda.set_sync_debug_mode('error')"
    from host_sync import HostSyncs

    sites = {}
    for m, step in steps.items():
        with HostSyncs() as syncs:
            step()
        sites[m] = syncs.by_site()
    first, *others = sites.values()
    growing = sorted({site for other in others for site in other
                      if other[site] != first.get(site)})
    assert not growing, f"per micro-batch or message: {growing}"
    return f"host syncs per step, at m = {sorted(sites)}: {first}"


def worker_job(machine: Machine, ranks: int, raw: bool = False) -> Job:
    """`gpu_check_worker` on ``ranks`` ranks; ``raw``: sharing GPU 0 (see the worker)."""
    out = Path(tempfile.mkdtemp(prefix=f"gpu-check-{ranks}-"))
    if machine.cuda:
        env = {"CUDA_VISIBLE_DEVICES": "0"} if raw else {}
    else:
        env = {"PIPELINE_LIB_DEVICE": "cpu"}
    return Job(f"DistributedPipe, {ranks} rank(s)" + (", raw" if raw else ""), ranks,
               [REPO / "bench" / "gpu_check_worker.py", "--out", out, "--backend",
                ("nccl" if machine.cuda else "gloo") if raw else "default"]
               + (["--raw"] if raw else []), env, out)


def distributed_rows(table: Table, machine: Machine, job: Job, how: str) -> None:
    """The rows of one `gpu_check_worker` job: ``how`` says on what it ran."""
    from dist_worker import batch, token_loss
    from gpu_check_worker import DROPOUT, DROPOUT_SCHEDULE, SEED
    from pipeline_lib.schedules import stages_per_rank

    output = job.wait(table.log)
    ranks = [json.loads((job.out / f"rank{r}.json").read_text())
             for r in range(len(list(job.out.glob("rank*.json"))))]
    with table.row("DistributedPipe", f"every schedule's gradients = one process ({how})") as row:
        failed = {s: e for rank in ranks for s, e in rank["schedules"].items() if e}
        assert not failed, "; ".join(f"{s}: {e}" for s, e in failed.items())
        row.detail = f"{len(ranks[0]['schedules'])} schedules on {ranks[0]['backend']}, " \
                     f"{[rank['device'] for rank in ranks]}"
    with table.row("DistributedPipe", f"dropout masks = the threaded Pipe's ({how})"):
        from dist_worker import tiny_lm

        got = {n: g for r in range(len(ranks))
               for n, g in torch.load(job.out / f"dropout-rank{r}.pt").items()}
        got = {name: got[name] for name, _ in tiny_lm().named_parameters()}   # model order
        # the worker's stages (two per rank), each on a thread of its own here
        pipe = threaded_pipe(machine, "1f1b", dropout=DROPOUT, checkpoint="never",
                             ranks=len(ranks) * stages_per_rank(DROPOUT_SCHEDULE))
        torch.manual_seed(SEED)
        pipe.step(*batch(), token_loss, "1f1b")
        assert_grads(pipe, got)
    with table.row("DistributedPipe", f"clip_grad_norm_ = PyTorch's on the whole model ({how})"):
        failed = [rank["clip"] for rank in ranks if rank["clip"]]
        assert not failed, failed[0]
    with table.row("DistributedPipe", f"a steady-state step makes the host wait for "
                                      f"nothing ({how})") as row:
        failed = [rank["sync"]["detail"] for rank in ranks if not rank["sync"]["ok"]]
        assert not failed, failed[0]
        row.detail = ranks[0]["sync"]["detail"]
    with table.row("launch", f"each rank says at start where it computes ({how})") as row:
        said = [line for line in output.splitlines() if re.match(r"rank \d+ on ", line)]
        if not said and "raw" in job.name:
            raise Skip("joined without job.process_group, which says it")
        assert len(said) == len(ranks), f"{len(said)} lines for {len(ranks)} ranks"
        row.detail = said[0][:150]


def shared_gpu_rows(table: Table, machine: Machine, job: Job) -> bool:
    """Two NCCL ranks on one GPU: NCCL usually refuses ("Duplicate GPU detected"). True
    if it ran (its rows are then added)."""
    try:
        job.wait(table.log)
    except RuntimeError as exc:
        table.add("DistributedPipe", "2 NCCL ranks sharing one GPU", "skip",
                  f"refused: {exc}".replace(f"job {job.name} exited with", "exit"))
        return False
    distributed_rows(table, machine, job, "2 NCCL ranks sharing cuda:0")
    return True


def train_job(name: str, machine: Machine, steps: int, *extra: Any) -> Job:
    """`lm.train` on as many GPUs as there are, up to 2 (or the CPU), bf16 and clipped."""
    ranks = min(max(machine.gpus, 1), 2)
    args = ["-m", "pipeline_lib.lm.train", "--pp", ranks, "--synthetic", 50, "--batch", 8,
            "--bptt", 16, "--microbatches", 2, "--steps", steps, "--log-every", 1,
            "--eval-every", 0, "--eval-steps", 2, "--dtype", "bf16", "--clip", 0.5,
            "--timeout", 120, *extra]
    return Job(name, ranks, args, {} if machine.cuda else {"PIPELINE_LIB_DEVICE": "cpu"})


def logged(output: str) -> dict[int, float]:
    """Step -> loss, from lm.train's log lines."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step +(\d+) +loss ([\d.]+)", output,
                                                        re.MULTILINE)}


def train_rows(table: Table, machine: Machine, whole: Job, saving: Job, folder: Path) -> None:
    device = "cuda:0" if machine.cuda else "cpu"
    with table.row("lm.train", f"the log names the rank that timed the layers, on {device}") as row:
        output = whole.wait(table.log)
        said = re.search(r"\(by time on (\S+) of rank 0\)", output)
        assert said and said[1] == device, "no '(by time on ... of rank 0)' in the log"
        assert "valid loss" in output, "no validation loss in the log"
        row.detail = said[0]
    with table.row("lm.train", f"bf16, clipped: saved after step 3, resumed, logs what an "
                               f"uninterrupted run logs ({device})") as row:
        saving.wait(table.log)
        resumed = train_job("lm.train resumed", machine, 5, "--resume", folder)
        after = logged(resumed.wait(table.log))
        before = logged(whole.output)
        assert sorted(after) == [4, 5], f"the resumed run logged steps {sorted(after)}"
        for step, loss in after.items():   # CUDA's embedding backward adds in any order
            assert abs(loss - before[step]) <= 2e-3 + 1e-3 * abs(before[step]), (
                f"step {step}: {loss} resumed, {before[step]} uninterrupted")
        row.detail = f"losses {[after[s] for s in (4, 5)]} (uninterrupted: " \
                     f"{[before[s] for s in (4, 5)]})"


def speed_rows(table: Table, machine: Machine, steps: int) -> list[dict]:
    """`Pipe.step` against the plain step: on 2 GPUs as a fraction of the ideal speedup,
    on one device its cost (nothing to overlap there). Runs before the jobs start."""
    from pipeline_lib import Pipe
    from pipeline_lib.lm.loops import lm_loss
    from pipeline_lib.lm.model import transformer_lm
    from timing import Runner, alternate, paired_ratio

    found = []
    p, m = 2, 8
    preset, vocab, batch = ("tutorial", TUTORIAL_VOCAB, 64) if machine.cuda else ("cpu", 2000, 16)
    torch.manual_seed(0)
    with torch.device(machine.device()):
        model = transformer_lm(vocab, preset, dropout=0.0)
    devices = [machine.device(0), machine.device(1)]
    inputs, target = (torch.randint(0, vocab, (batch, 35), device=machine.device())
                      for _ in range(2))
    sync = (lambda: [torch.cuda.synchronize(k) for k in range(machine.gpus)]) \
        if machine.cuda else (lambda: None)
    for schedule in ("gpipe", "1f1b"):
        with table.row("speed", f"Pipe.step, {preset} preset, m = {m}, {schedule}: on "
                                f"{'2 GPUs' if machine.gpus >= 2 else devices[0]}") as row:
            pipe = Pipe(copy.deepcopy(model), chunks=m, checkpoint="never",
                        balance=[len(model) // 2, len(model) - len(model) // 2], devices=devices)
            times = alternate({
                "plain": Runner(lambda: lm_loss(model(inputs), target).backward(),
                                lambda: model.zero_grad(set_to_none=True)),
                "pipe": Runner(lambda: pipe.step(inputs, target, lm_loss, schedule),
                               lambda: pipe.zero_grad(set_to_none=True))},
                warmup=2, steps=steps, sync=sync)
            speedup, ideal = paired_ratio(times["plain"], times["pipe"]), p * m / (m + p - 1)
            result = {"preset": preset, "schedule": schedule, "microbatches": m,
                      "devices": [str(d) for d in devices], "speedup": round(speedup, 3)}
            row.result = "info"
            if machine.gpus >= 2:
                result.update(ideal=round(ideal, 3), fraction_of_ideal=round(speedup / ideal, 3))
                row.detail = (f"{speedup:.2f}x the one-GPU step, {speedup / ideal:.0%} of the "
                              f"ideal {ideal:.2f}x")
            else:
                row.detail = (f"{1 / speedup:.2f}x the plain step's time (one device: no "
                              f"pipelining to gain, this is the executor's cost)")
            found.append(result)
            del pipe
    del model
    if machine.cuda:
        torch.cuda.empty_cache()
    return found


def run(args: argparse.Namespace, log: io.TextIOBase) -> Table:
    machine = Machine(0 if args.cpu else torch.cuda.device_count())
    table = Table(log)
    environment(table, machine)
    table.speed = speed_rows(table, machine, args.steps)
    one_rank = worker_job(machine, 1)
    pair = worker_job(machine, 2, raw=machine.gpus == 1)
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-run-"))
    whole = train_job("lm.train, 5 steps", machine, 5)
    saving = train_job("lm.train, 3 steps saved", machine, 3, "--save", folder)
    pytest_rows(table, log)
    pipe_rows(table, machine)
    how = "NCCL, cuda:0" if machine.cuda else "gloo, CPU"
    distributed_rows(table, machine, one_rank, f"1 rank, {how}")
    if machine.gpus == 1:
        ran = shared_gpu_rows(table, machine, pair)
        if not ran:
            table.add("DistributedPipe", "every schedule on 2 ranks over NCCL", "skip", "1 GPU")
    else:
        distributed_rows(table, machine, pair, "2 ranks, " + (
            "NCCL, cuda:0 and cuda:1" if machine.cuda else "gloo, CPU"))
    train_rows(table, machine, whole, saving, folder)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="every row on the CPU over gloo (the script's own test)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each run")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "out"))
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA GPU found: checking the script on the CPU instead (--cpu)")
        args.cpu = True
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(args.out / "gpu_check.log", "w") as log:
        table = run(args, log)
    table.print()
    failed = [row for row in table.rows if row.result == "FAIL"]
    report = {"passed": not failed, "seconds": round(time.perf_counter() - start, 1),
              "cpu": args.cpu, "torch": torch.__version__,
              "gpus": [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())],
              "rows": [asdict(row) for row in table.rows], "speed": table.speed}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"{'PASSED' if not failed else f'FAILED: {len(failed)} row(s)'} in "
          f"{report['seconds']:.0f} s; {args.out / 'gpu_check.json'}, "
          f"{args.out / 'gpu_check.log'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
