"""The multi-process pipeline computes what one process computes, and fails loudly.

Processes are real: torchrun launches `dist_worker.py` on gloo. Each launch runs every
schedule and saves what each rank computed; the tests compare it with unpipelined
training in this process. Ten launches in all (2 and 4 processes, changing shapes,
seven failures, one of them across two torchrun "machines").
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dist_worker as worker
from pipeline_lib import Pipe
from pipeline_lib.distributed.launch import kill_job
from pipeline_lib.lowering import lower
from pipeline_lib.schedules import build, plan
from pipeline_lib.timeline import Timeline, simulate, simulate_measured

REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 150
CASES = [(mesh, name) for mesh in ("2x1", "4x1", "2x2") for name in worker.SCHEDULES
         if worker.runs_on(mesh, name)]


def torchrun(nproc: int, *args: str, machines: int = 1, flags: tuple[str, ...] = (),
             worker: str = "dist_worker.py") -> tuple[subprocess.CompletedProcess, float]:
    """Run the ``worker`` script, ``nproc`` processes per machine; past the deadline, kill
    torchrun and its workers. ``machines`` > 1 starts that many torchrun agents, as on
    separate machines: each stops only its own workers when one fails."""
    if machines == 1:
        where = ["--standalone"]
    else:
        with socket.socket() as free:
            free.bind(("localhost", 0))
            port = free.getsockname()[1]
        where = [f"--nnodes={machines}", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}"]
    command = [sys.executable, "-m", "torch.distributed.run", *where, *flags,
               "--nproc_per_node", str(nproc), str(REPO / "tests" / worker), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env, cwd=REPO, start_new_session=True)
                 for _ in range(machines)]
    outputs, codes = [], []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=LAUNCH_TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            hung = "\n".join(kill_job(p) for p in processes)
            pytest.fail(f"torchrun {' '.join(args)} hung for {LAUNCH_TIMEOUT} s:\n{hung}")
        codes.append(process.returncode)
    done = subprocess.CompletedProcess(command, max(codes, key=abs), "\n".join(outputs), "")
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(mesh)`` -> the folder where the launch covering ``mesh`` saved its
    files; one launch per process count, on first use."""
    folders: dict[int, Path] = {}

    def folder(mesh: str) -> Path:
        pp, dp = (int(n) for n in mesh.split("x"))
        if pp * dp not in folders:
            out = tmp_path_factory.mktemp(f"ranks{pp * dp}")
            meshes = "2x1" if pp * dp == 2 else "4x1,2x2"
            done, _ = torchrun(pp * dp, "--scenario", "schedules", "--meshes", meshes,
                               "--out", str(out))
            assert done.returncode == 0, done.stdout + done.stderr
            folders[pp * dp] = out
        return folders[pp * dp]
    return folder


Tensors = dict[str, torch.Tensor]


def reference(name: str, pp: int) -> tuple[float, Tensors, Tensors]:
    """Loss, gradients and parameters after one SGD step of the whole batch, unpipelined;
    with dropout, by the threaded `Pipe.step`, whose masks the processes must reproduce
    (in their second step, so this one's too)."""
    inputs, target = worker.batch()
    if name.endswith("dropout"):
        model = worker.tiny_lm(worker.DROPOUT)
        pipe = Pipe(model, worker.MICROBATCHES, "never", [len(model) // pp] * pp)
        for _ in range(2):
            pipe.zero_grad(set_to_none=True)
            loss = pipe.step(inputs, target, worker.token_loss, "1f1b")
    else:
        model = worker.tiny_lm()
        loss = worker.token_loss(model(inputs), target)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    params = {n: (p - worker.LR * p.grad).detach() for n, p in model.named_parameters()}
    return loss.item(), grads, params


def load_ranks(folder: Path, mesh: str, name: str) -> list[dict]:
    pp, dp = (int(n) for n in mesh.split("x"))
    return [torch.load(folder / f"{mesh}-{name}-rank{r}.pt") for r in range(pp * dp)]


@pytest.mark.parametrize("mesh,name", CASES)
def test_step_equals_unpipelined_training(results, mesh, name):
    """Every replica ends with the whole batch's loss and gradients, and after an SGD
    step with the parameters of unpipelined training, identical across replicas."""
    pp, dp = (int(n) for n in mesh.split("x"))
    ref_loss, ref_grads, ref_params = reference(name, pp)
    ranks = load_ranks(results(mesh), mesh, name)
    replicas = [ranks[d * pp:(d + 1) * pp] for d in range(dp)]
    for replica in replicas:
        assert replica[-1]["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert all(r["loss"] is None for r in replica[:-1])
        grads = {n: g for r in replica for n, g in r["grads"].items()}
        assert grads.keys() == ref_grads.keys()
        assert sum(len(r["grads"]) for r in replica) == len(ref_grads)   # each once
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        for r in replica:
            for n, p in r["params"].items():
                torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-7, msg=n)
    for pipe_rank in range(pp):
        first = replicas[0][pipe_rank]["params"]
        for replica in replicas[1:]:
            assert all(torch.equal(first[n], p) for n, p in replica[pipe_rank]["params"].items())


@pytest.mark.parametrize("mesh,name", CASES)
def test_timeline_has_every_action_in_program_order(results, mesh, name):
    pp, dp = (int(n) for n in mesh.split("x"))
    record = json.loads((results(mesh) / f"{mesh}-{name}-timeline.json").read_text())
    timeline = Timeline.from_dict(record["timeline"])
    assert timeline.ranks == pp * dp and timeline.unit == "s"
    assert min(e.start for e in timeline.events) == 0.0
    for rank in range(pp * dp):
        events = sorted((e for e in timeline.events if e.rank == rank), key=lambda e: e.start)
        assert [str(e.action) for e in events] == record["programs"][rank % pp]
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))


def failing_run(nproc: int, *args: str, within: float = 60, **how: object) -> str:
    """The output of a launch that must fail, every rank stopped within ``within`` s."""
    done, seconds = torchrun(nproc, *args, **how)  # type: ignore[arg-type]
    assert done.returncode != 0
    assert seconds < within
    return done.stdout + done.stderr


def failed_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r"rank \d+ failed", line)]


def test_failing_rank_stops_every_rank_and_names_it():
    """Rank 0 is computing (a forward of `worker.SLEEP` = 120 s) when rank 1 fails:
    torchrun stops it, and rank 1's error is the one reported."""
    output = failing_run(2, "--scenario", "raise")
    [failed] = failed_lines(output)
    assert failed.startswith("rank 1 failed: RuntimeError: boom: injected failure")
    assert "running 1F1 of GPipe" in failed


def test_watchdog_stops_a_rank_on_another_machine():
    """torchrun on rank 0's machine does not stop it when rank 1 fails on another: the
    watchdog does, naming rank 1's error (not a failed wait of its own: "here: ...")."""
    output = failing_run(1, "--scenario", "raise", machines=2, within=90)
    assert "rank 1 failed: RuntimeError: boom: injected failure" in output
    stopped = [line for line in output.splitlines() if line.startswith("rank 0: stopping")]
    assert len(stopped) == 1 and "because rank 1 failed" in stopped[0]
    assert "(here:" not in stopped[0]


def test_killed_rank_is_reported_lost_not_as_the_failure_of_the_rank_that_noticed():
    """Rank 1's process dies without a word (like the OOM killer's victim) while rank 0
    waits for its message. (torchrun looks every 2 s, so that rank 0 notices first.)"""
    output = failing_run(2, "--scenario", "killed", flags=("--monitor-interval=2",))
    assert ("rank 1 lost: its process ended without reporting an error (killed, e.g. by "
            "the out-of-memory killer?) while rank 0 was receiving the gradient for stage 0"
            in output)
    assert failed_lines(output) == []


def test_ranks_given_different_mesh_arguments_are_named():
    output = failing_run(2, "--scenario", "mesh_args")
    assert ("the ranks were given different init_mesh arguments: rank 0 has {'pp': 2, "
            "'dp': 1, 'timeout': 60.0, 'order': 'replica-major'}; rank 1 has {'pp': 1, "
            "'dp': 2, 'timeout': 60.0, 'order': 'replica-major'}" in output)


def test_ranks_running_different_step_counts_are_named():
    """Rank 1 runs one step fewer: one of them times out (after 10 s) and says why."""
    output = failing_run(2, "--scenario", "steps", "--timeout", "10")
    assert "the ranks ran different numbers of steps" in output or \
        "did the ranks run different numbers of steps?" in output, output


def test_shape_mismatch_between_stages_is_reported_not_hung():
    """Rank 0 notices through its closed connection to rank 1 (torchrun, looking every
    2 s, has not stopped it yet) and names rank 1's error, not its own."""
    output = failing_run(2, "--scenario", "mismatch", flags=("--monitor-interval=2",))
    assert "rank 0: stopping because rank 1 failed: RuntimeError: mat1 and mat2" in output
    assert "stage 1's input for micro-batch 0, from stage 0 on pipe rank 0, was " \
           "float32[2, 16]" in output


def test_steps_whose_shapes_change_equal_unpipelined_training(tmp_path):
    """A step with a new shape waits for each header again; one with the last step's
    shapes receives into buffers posted early, sized by the last step's headers."""
    done, _ = torchrun(2, "--scenario", "shapes", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    model, (inputs, target) = worker.tiny_lm(), worker.batch()
    with torch.no_grad():
        expected = [worker.token_loss(model(inputs[:, :n]), target[:, :n]).item()
                    for n in worker.SEQ_LENGTHS]
    assert torch.load(tmp_path / "shapes-rank0.pt")["losses"] == [None] * len(expected)
    assert torch.load(tmp_path / "shapes-rank1.pt")["losses"] == pytest.approx(expected,
                                                                               rel=1e-5)


def test_output_shape_that_changes_without_the_batch_is_reported_not_hung():
    output = failing_run(2, "--scenario", "reshape")
    assert ("rank 0 failed: ProtocolError: rank 0: the activation for stage 1, micro-batch 0 "
            "is float32[2, 4] in this step but was float32[2, 8] in the last one") in output


# -- in-process: the parts that need no second process ---------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_needed_message_is_sent_exactly_once(name, ranks):
    """A receiver waits for what its program needs; the lowered programs must send each
    of those exactly once, from the rank that holds the producing stage (to itself where
    it holds both stages), and list it in that rank's channel to the receiver (what `p2p`
    receives in the sender's order)."""
    schedule = build(name, ranks, 6 if name == "interleaved_1f1b" and ranks == 3 else 4)
    lowered, last = lower(schedule), schedule.stages - 1
    sent = sorted((send.peer, str(send.message)) for program in lowered.programs
                  for step in program for send in step.sends)
    remote = sorted((send.peer, str(send.message)) for r, program in enumerate(lowered.programs)
                    for step in program for send in step.sends if send.peer != r)
    assert sorted((dst, str(m)) for src in range(ranks) for dst in range(ranks) if src != dst
                  for m in lowered.channel(src, dst)) == remote
    needed = sorted(
        (rank, f"the {'activation' if a.kind == 'F' else 'gradient'} for stage {a.stage}, "
               f"micro-batch {a.microbatch}")
        for rank in range(ranks) for a in schedule.actions[rank]
        if (a.kind == "F" and a.stage > 0) or (a.kind in ("B", "I") and a.stage < last))
    assert sent == needed


def test_plan_explains_a_balance_that_does_not_fit():
    with pytest.raises(ValueError, match="give 2 entries"):
        plan("1f1b", 2, 3, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        plan("interleaved_1f1b", 2, 3, 4)
    assert plan("interleaved_1f1b", 2, 6, 4).virtual_stages == 3


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_simulate_measured_recovers_the_costs_of_a_timeline(name):
    schedule = build(name, 3, 4)
    costs = dict(forward=[1.0, 2.0, 1.5], backward=[2.0, 4.0, 3.0], weight=[0.5, 1.0, 1.0])
    timeline = simulate(schedule, **costs)
    again = simulate_measured(schedule, timeline)
    assert again.makespan == pytest.approx(timeline.makespan)
    durations = [e.duration for e in timeline.events]
    assert [e.duration for e in again.events] == pytest.approx(durations)
