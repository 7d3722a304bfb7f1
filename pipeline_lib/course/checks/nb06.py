"""Checks of notebook 06's exercises (PyTorch's own pipeline runtime).

* **6.1** (activations between two processes): the result alone cannot tell a pipeline
  from a rank that rebuilt the whole model and never sent anything, so the check watches
  the messages. `run_in_threads` runs the learner's ``run_stage`` for both ranks in this
  process, with ``torch.distributed``'s point-to-point calls replaced by a small recording
  transport (a deadlock is found at once: both ranks waiting to receive); `send_recv_worker`
  runs it under ``torchrun`` with the real calls, counted. Either way `verify_send_recv`
  checks what each rank sent (one activation forward, one gradient back, their values),
  the output and every gradient against the unpipelined model. A right answer may be
  written with ``send``/``recv``, ``isend``/``irecv`` or ``batch_isend_irecv``, named
  through ``dist.`` or imported from ``torch.distributed``: both ways reach them all.
* **6.2** (PyTorch's lowered action lists): the expected schedules are read first with
  `pytorch_schedule`, which is the reference solution, and the learner's function then
  runs inside `withheld`, where calling it fails. The cases include 4 stages per rank (so
  a 2 written in fails), and the name passed is a label PyTorch does not know (so an
  answer that asks PyTorch for the named schedule instead of reading ``ops`` fails).
* **6.3** (pipeline and data-parallel groups on a ``dp × pp`` mesh): ``dist.new_group`` is
  collective, so the check runs the learner's ``make_groups`` once per rank in this process
  with a recording ``new_group`` and checks that every rank creates the same groups in the
  same order (else the job hangs) and gets back the right two.

Every check raises `ExerciseFailed` with what to change; the notebook's check cell runs it
inside ``exercise("Exercise 6.N (...)")``, which prefixes the exercise's name.
"""
from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor, nn

from pipeline_lib.course.exercises import ExerciseFailed, hidden_cases, withheld
from pipeline_lib.course.pytorch_schedules import get_schedule_ops, pytorch_schedule
from pipeline_lib.schedules import Schedule, ScheduleError, validate

__all__ = ["tiny_model", "stage_of", "run_in_threads", "verify_send_recv", "check_send_recv",
           "read_worker_results", "check_from_lowered", "LOWERED_CASES", "check_groups",
           "MESHES"]

ROWS, WIDTH, HIDDEN = 4, 8, 16


def _fail(message: str) -> None:
    raise ExerciseFailed(message)


# -- 6.1: activations between two processes ----------------------------------------------

def tiny_model() -> nn.Sequential:
    """Exercise 6.1's model, the same weights every call: Linear(8, 16), Tanh, Linear(16, 8)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, WIDTH, generator=generator),
            torch.randn(ROWS, WIDTH, generator=generator))


def stage_of(rank: int) -> nn.Sequential:
    """Rank ``rank``'s stage, cut from a fresh `tiny_model` (keeps the names "0.weight",
    "2.weight"): a rank holds its own layers and nothing of the other's."""
    model = tiny_model()
    return model[:2] if rank == 0 else model[2:]


@dataclass
class Sent:
    """One point-to-point message: who sent it to whom, and a copy of the tensor."""

    src: int
    dst: int
    tensor: Tensor


class _Deadlock(RuntimeError):
    pass


class _Threads:
    """Two ranks as two threads of this process, messages through a shared mailbox.

    Stands in for ``torch.distributed``'s ``send``/``recv``/``isend``/``irecv``: a
    message is kept (a copy, as a real send makes) until its receiver asks for it, and a
    receive that waits while the other rank waits too, or has returned, is a deadlock.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.mail: dict[tuple[int, int], list[Tensor]] = {}
        self.sent: list[Sent] = []
        self.waiting: set[int] = set()
        self.done: set[int] = set()
        self.ranks: dict[int, int] = {}            # thread id -> rank

    def rank(self) -> int:
        return self.ranks[threading.get_ident()]

    def send(self, tensor: Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
             group_dst: int | None = None) -> None:
        src = self.rank()
        dst = group_dst if dst is None else dst
        if not isinstance(tensor, Tensor):
            raise TypeError(f"rank {src}: send() takes a tensor, got {type(tensor).__name__}")
        if dst not in (0, 1) or dst == src:
            raise ValueError(f"rank {src}: send(dst={dst}): the other rank is {1 - src}")
        copy = tensor.detach().clone()
        with self.lock:
            self.sent.append(Sent(src, dst, copy))
            self.mail.setdefault((src, dst), []).append(copy)
            self.lock.notify_all()

    def recv(self, tensor: Tensor, src: int | None = None, group: Any = None,
             tag: int = 0, group_src: int | None = None) -> int:
        dst = self.rank()
        src = group_src if src is None else src
        src = 1 - dst if src is None else src
        with self.lock:
            self.waiting.add(dst)
            try:
                while not self.mail.get((src, dst)):
                    other_stuck = src in self.waiting and not self.mail.get((dst, src))
                    if src in self.done or other_stuck:
                        raise _Deadlock(
                            f"rank {dst} waits for a message from rank {src}, which "
                            + ("has returned without sending it" if src in self.done else
                               f"waits for a message from rank {dst} too"))
                    if not self.lock.wait(timeout=30):
                        raise _Deadlock(f"rank {dst} waited 30 s for rank {src}")
            finally:
                self.waiting.discard(dst)
            message = self.mail[(src, dst)].pop(0)
        if message.shape != tensor.shape or message.dtype != tensor.dtype:
            raise RuntimeError(f"rank {dst} receives into a {tuple(tensor.shape)} "
                               f"{tensor.dtype} tensor a message of {tuple(message.shape)} "
                               f"{message.dtype} from rank {src}")
        with torch.no_grad():
            tensor.copy_(message)
        return src

    def isend(self, tensor: Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
              group_dst: int | None = None) -> "_Done":
        self.send(tensor, dst, group_dst=group_dst)
        return _Done(lambda: None)

    def irecv(self, tensor: Tensor, src: int | None = None, group: Any = None,
              tag: int = 0, group_src: int | None = None) -> "_Done":
        return _Done(lambda: self.recv(tensor, src, group_src=group_src))

    def finished(self, rank: int) -> None:
        with self.lock:
            self.done.add(rank)
            self.lock.notify_all()


class _Done:
    """What isend/irecv return: ``wait()`` completes the operation."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self.finish, self.finished = finish, False

    def wait(self, timeout: Any = None) -> bool:
        if not self.finished:
            self.finish()
            self.finished = True
        return True

    def is_completed(self) -> bool:
        return self.finished


class _P2POp:
    """``dist.P2POp`` while a check runs: PyTorch's own refuses any ``op`` but its own
    ``isend``/``irecv``, which the check has replaced (to record or count the messages)."""

    def __init__(self, op: Callable[..., Any], tensor: Tensor, peer: int | None = None,
                 group: Any = None, tag: int = 0, group_peer: int | None = None) -> None:
        self.op, self.tensor = op, tensor
        self.peer = group_peer if peer is None else peer


def _batch_isend_irecv(ops: Sequence[_P2POp]) -> list[Any]:
    """``dist.batch_isend_irecv`` on `_P2POp`s: each operation posted in order, as gloo
    (which cannot coalesce them) posts them too."""
    return [op.op(op.tensor, op.peer) for op in ops]


@contextmanager
def _rebound(replacements: dict[str, Callable[..., Any]],
             *namespaces: dict[str, Any] | None) -> Iterator[None]:
    """``torch.distributed``'s functions named in ``replacements`` replaced, in the package
    and in ``namespaces``: the learner's module (``from torch.distributed import send``
    binds a name of its own there), and ``distributed_c10d`` where its own helpers must
    see them too (``new_subgroups_by_enumeration`` calls ``new_group`` there; not where a
    replacement calls the original, since ``send`` itself calls ``isend`` there);
    everything restored afterwards."""
    spaces = [vars(dist)] + [space for space in namespaces if space is not None]
    originals = {id(getattr(dist, name)): name for name in replacements}
    saved = [(space, key, value) for space in spaces for key, value in list(space.items())
             if callable(value) and id(value) in originals]
    try:
        for space, key, value in saved:
            space[key] = replacements[originals[id(value)]]
        yield
    finally:
        for space, key, value in saved:
            space[key] = value


def _patched(threads: _Threads, namespace: dict[str, Any] | None) -> Any:
    """``torch.distributed``'s point-to-point calls and rank queries, on ``threads``."""
    return _rebound({"send": threads.send, "recv": threads.recv, "isend": threads.isend,
                     "irecv": threads.irecv, "get_rank": threads.rank,
                     "get_world_size": lambda group=None: 2, "P2POp": _P2POp,
                     "batch_isend_irecv": _batch_isend_irecv}, namespace)


def run_in_threads(run_stage: Callable[..., Tensor | None]) -> list[dict[str, Any]]:
    """Run ``run_stage(rank, stage, x, target)`` for ranks 0 and 1 at once, in two threads
    of this process, each with only its own stage; per rank: its ``output``, its stage's
    ``grads``, what it ``sent`` and the ``error`` it raised (None if none)."""
    threads = _Threads()
    x, target = _batch()
    stages = [stage_of(0), stage_of(1)]
    results: list[dict[str, Any]] = [{"output": None, "error": None} for _ in range(2)]

    def rank_main(rank: int) -> None:
        threads.ranks[threading.get_ident()] = rank
        try:
            results[rank]["output"] = run_stage(rank, stages[rank], x.clone(), target.clone())
        except BaseException as error:          # reported by the check, with the rank
            results[rank]["error"] = error
        finally:
            threads.finished(rank)

    with (_patched(threads, getattr(run_stage, "__globals__", None)),
          withheld("pipeline_lib.distributed.p2p")):
        workers = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (0, 1)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        if any(worker.is_alive() for worker in workers):
            _fail("run_stage did not return within 60 s on one of the ranks")
    for rank, stage in enumerate(stages):
        results[rank]["grads"] = {name: p.grad for name, p in stage.named_parameters()}
        results[rank]["sent"] = [s for s in threads.sent if s.src == rank]
    return results


def _expected() -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """The unpipelined model's activation at the cut, its gradient, output and gradients."""
    model = tiny_model()
    x, target = _batch()
    activation = model[:2](x)
    activation.retain_grad()
    output = model[2:](activation)
    nn.functional.mse_loss(output, target).backward()
    return (activation.detach(), activation.grad, output.detach(),
            {name: p.grad for name, p in model.named_parameters()})


def verify_send_recv(results: Sequence[dict[str, Any]]) -> None:
    """Both ranks' results (from `run_in_threads` or the torchrun worker) are a pipeline:
    rank 0 sent the cut's activation, rank 1 sent back its gradient, each once; rank 1
    returned the unpipelined model's output; every gradient is the unpipelined one's."""
    for rank, part in enumerate(results):
        error = part["error"]
        if isinstance(error, NotImplementedError) or "NotImplementedError" in str(error or ""):
            raise NotImplementedError
        if error is not None:
            if isinstance(error, ExerciseFailed):
                raise error
            _fail(f"rank {rank} raised {type(error).__name__}: {error}"
                  + (". Each rank must send before the other waits for that message: rank 0 "
                     "sends the activation first, rank 1 sends the gradient after its "
                     "backward" if isinstance(error, _Deadlock) or "Timed out" in str(error)
                     else ""))
    activation, activation_grad, expected, grads = _expected()
    for src, what, want in [(0, "the activation (rank 0's stage output)", activation),
                            (1, "the gradient of the loss with respect to the activation "
                                "it received", activation_grad)]:
        sent = results[src]["sent"]
        shapes = [tuple(s.tensor.shape) for s in sent]
        _check(len(sent) == 1, f"rank {src} sent {len(sent)} messages {shapes}; it must send "
               f"exactly one, {what}, to rank {1 - src}"
               + (". A rank that computes the other rank's layers itself is not a pipeline: "
                  "each rank holds only its stage" if src == 0 and not sent else
                  ", after its backward" if src == 1 and not sent else ""))
        message = sent[0]
        _check(message.dst == 1 - src, f"rank {src} sent its message to rank {message.dst}; "
               f"send it to rank {1 - src}")
        _check(message.tensor.shape == want.shape and torch.allclose(message.tensor, want,
                                                                      atol=1e-6),
               f"rank {src} sent a {tuple(message.tensor.shape)} tensor that is not {what} "
               f"({tuple(want.shape)})" + (_gradient_hint(message.tensor, want)
                                            if src == 1 else ""))
    output = results[1]["output"]
    _check(isinstance(output, Tensor) and output.shape == expected.shape,
           f"rank 1 must return the output, a tensor of shape {tuple(expected.shape)}; it "
           f"returned {output if not isinstance(output, Tensor) else tuple(output.shape)}")
    _check(torch.allclose(output, expected, atol=1e-6),
           f"rank 1's output differs from the unpipelined model's by "
           f"{(output - expected).abs().max().item():.2e}: does rank 1 run its stage on "
           f"the activation rank 0 sent?")
    _check(results[0]["output"] is None, "rank 0 must return None (the loss and the output "
           "are rank 1's)")
    for rank, part in enumerate(results):
        for name, grad in part["grads"].items():
            want = grads[name]
            _check(grad is not None, f"rank {rank}: {name} has no gradient: did the "
                   f"backward reach stage {rank}" + (" (the gradient received from rank 1, "
                   "backpropagated with activation.backward(grad))?" if rank == 0 else "?"))
            _check(torch.allclose(grad, want, atol=1e-6),
                   f"rank {rank}: the gradient of {name} differs from the unpipelined "
                   f"model's by {(grad - want).abs().max().item():.2e}"
                   + (": backpropagate the gradient rank 1 sent, activation.backward(grad)"
                      if rank == 0 else ""))


def _gradient_hint(sent: Tensor, want: Tensor) -> str:
    """What to look at when rank 1's message is not the activation's gradient: a gradient
    off by a constant factor comes from another loss (a sum instead of MSE's mean); zeros,
    or anything else, from a received activation that took no part in the backward."""
    if sent.shape == want.shape:
        factor = (sent * want).sum() / (want * want).sum()
        if (torch.allclose(sent, factor * want, atol=1e-6)
                and abs(factor.item()) > 1e-3 and abs(factor.item() - 1) > 1e-4):
            return (f": it is {factor.item():.4g} times that gradient. The loss is "
                    f"nn.functional.mse_loss(output, target), with its default mean")
    return (": did rank 1 call requires_grad_() on the received activation before its "
            "forward, and send activation.grad?")


def _check(ok: bool, message: str) -> None:
    if not ok:
        _fail(message)


def check_send_recv(run_stage: Callable[..., Tensor | None]) -> None:
    """Exercise 6.1 in this process: `run_in_threads`, then `verify_send_recv`."""
    if not callable(run_stage):
        _fail(f"run_stage must be a function, got {type(run_stage).__name__}")
    verify_send_recv(run_in_threads(run_stage))


def send_recv_worker(module: str, out: Path) -> None:
    """The torchrun side of exercise 6.1: this rank runs ``module.run_stage`` on its stage
    with the real ``dist.send``/``dist.recv``, counted, and saves its results to
    ``out/rank{rank}.pt`` (the error it raised, as text, if any)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    sent: list[Sent] = []
    send, isend = dist.send, dist.isend

    def counted_send(tensor: Tensor, dst: int | None = None, *args: Any, **kwargs: Any) -> Any:
        sent.append(Sent(rank, kwargs.get("group_dst") if dst is None else dst,
                         tensor.detach().clone()))
        return send(tensor, dst, *args, **kwargs)

    def counted_isend(tensor: Tensor, dst: int | None = None, *args: Any, **kwargs: Any
                      ) -> Any:
        sent.append(Sent(rank, kwargs.get("group_dst") if dst is None else dst,
                         tensor.detach().clone()))
        return isend(tensor, dst, *args, **kwargs)

    stage = stage_of(rank)
    x, target = _batch()
    output, error = None, None
    answer = importlib.import_module(module)
    with _rebound({"send": counted_send, "isend": counted_isend, "P2POp": _P2POp,
                   "batch_isend_irecv": _batch_isend_irecv}, vars(answer)):
        try:
            output = answer.run_stage(rank, stage, x, target)
        except Exception as raised:     # for the check: which rank failed, and why
            error = f"{type(raised).__name__}: {raised}"
    torch.save({"output": output, "error": error, "sent": [vars(s) for s in sent],
                "grads": {name: p.grad for name, p in stage.named_parameters()}},
               out / f"rank{rank}.pt")
    if error is None:
        dist.destroy_process_group()


def read_worker_results(out: Path) -> list[dict[str, Any]]:
    """What `send_recv_worker` saved, in `verify_send_recv`'s form."""
    parts = []
    for rank in range(2):
        path = out / f"rank{rank}.pt"
        _check(path.exists(), f"rank {rank} saved no result (it was stopped before)")
        part = torch.load(path)
        part["sent"] = [Sent(**s) for s in part["sent"]]
        parts.append(part)
    return parts


# -- 6.2: PyTorch's lowered action lists ---------------------------------------------------

#: (PyTorch's schedule, ranks, micro-batches, virtual stages per rank): looped and
#: V-shaped, with and without I/W, and one with 4 stages per rank (V-shaped ones have 2).
LOWERED_CASES: tuple[tuple[str, int, int, int], ...] = (
    ("Interleaved1F1B", 2, 4, 2), ("InterleavedZeroBubble", 4, 8, 2),
    ("InterleavedZeroBubble", 2, 4, 4), ("ZBVZeroBubble", 2, 4, 2),
    ("ZBVZeroBubble", 4, 8, 2), ("DualPipeV", 2, 4, 2))


def _lowered(name: str, ranks: int, microbatches: int, virtual: int) -> list[list[Any]]:
    import logging
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logger = logging.getLogger("torch.distributed.pipelining.schedules")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            return get_schedule_ops(name, ranks, microbatches, virtual, with_comms=True)
        finally:
            logger.setLevel(level)


def _lowered_case(rng: Any) -> tuple[str, int, int, int]:
    """A PyTorch schedule and a size it accepts, for a drawn case."""
    name = rng.choice(["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                       "DualPipeV"])
    p = rng.randint(2, 4)
    v = 2 if name in ("ZBVZeroBubble", "DualPipeV") else rng.randint(2, 3)
    return name, p, p * v * rng.randint(1, 2) if name == "DualPipeV" else p * rng.randint(1, 3), v


def check_from_lowered(from_lowered: Callable[..., Schedule],
                       namespace: dict[str, Any] | None = None) -> None:
    """Exercise 6.2: ``from_lowered(ops, microbatches, name)`` reads each case of
    `LOWERED_CASES`, and two cases drawn for this run, as `pytorch_schedule` does
    (computed first), places the stages as it does, and the result validates. ``name`` is
    only a label, and not PyTorch's class name, so an answer must read ``ops``: asking
    PyTorch for the named schedule again fails. ``namespace`` is not needed any more (the
    reader is refused however it is reached) and is ignored: notebook 06's check cell
    still passes it."""
    cases = [(name, p, m, v, _lowered(name, p, m, v), pytorch_schedule(name, p, m, v))
             for name, p, m, v in
             [*LOWERED_CASES, *hidden_cases(_lowered_case, 2, shown=LOWERED_CASES)]]
    for name, p, m, v, ops, library in cases:
        with withheld("pipeline_lib.course.pytorch_schedules"):
            yours = from_lowered(ops, m, f"lowered {name}")
        _check(isinstance(yours, Schedule), f"return a Schedule, got {type(yours).__name__}")
        _check(yours.ranks == p, f"{name}: {yours.ranks} ranks in yours, {p} in the lowered "
               f"order (one list per rank)")
        for rank in range(p):
            got, want = yours.actions[rank], library.actions[rank]
            first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
            _check(got == want, f"{name}, p={p}, m={m}, rank {rank}: {len(got)} compute "
                   f"actions, PyTorch's order has {len(want)}; the first difference is at "
                   f"position {first}: yours {got[first] if first < len(got) else 'none'}, "
                   f"expected {want[first] if first < len(want) else 'none'}")
        where = [yours.rank_of(s) for s in range(yours.stages)]
        want_where = [library.rank_of(s) for s in range(library.stages)]
        _check((yours.stages, where) == (library.stages, want_where),
               f"{name}, p={p}, {v} stages per rank: stage s runs on rank {where} in yours, "
               f"on {want_where} in PyTorch's order: check virtual_stages (the number of "
               f"stages in the actions over the ranks) and placement")
        try:
            validate(yours)
        except ScheduleError as error:
            _fail(f"{name}, p={p}, m={m}: not a valid schedule: {error}")


# -- 6.3: pipeline and data-parallel groups -----------------------------------------------

#: (pp, dp) layouts the check tries: square, and both non-square orders.
MESHES: tuple[tuple[int, int], ...] = ((2, 2), (4, 2), (2, 3))


@dataclass(frozen=True)
class FakeGroup:
    """What the recording ``new_group`` returns: the group's ranks, in order."""

    ranks: tuple[int, ...]


def _groups_of(make_groups: Callable[..., Any], rank: int, pp: int, dp: int
               ) -> tuple[list[tuple[int, ...]], Any]:
    created: list[tuple[int, ...]] = []

    def new_group(ranks: Sequence[int] | None = None, *args: Any, **kwargs: Any) -> FakeGroup:
        # sorted, as torch.distributed sorts them: [1, 0] is the group [0, 1]
        group = FakeGroup(tuple(range(pp * dp)) if ranks is None else tuple(sorted(ranks)))
        created.append(group.ranks)
        return group

    with (_rebound({"new_group": new_group, "get_rank": lambda group=None: rank,
                    "get_world_size": lambda group=None: pp * dp},
                   vars(c10d), getattr(make_groups, "__globals__", None)),
          withheld("pipeline_lib.distributed.mesh")):
        returned = make_groups(rank, pp, dp)
    return created, returned


def check_groups(make_groups: Callable[..., Any]) -> None:
    """Exercise 6.3: on each of `MESHES` and on two meshes drawn for this run, every
    rank's ``make_groups(rank, pp, dp)`` creates the same groups in the same order
    (``new_group`` is collective), and returns ``(pipeline_group, data_group)``: the ranks
    of its replica's pipeline, rank ``replica * pp + pipe_rank``, and the ranks that hold
    the same stage. A message gives the group the learner's rank got, not the right one."""
    drawn = hidden_cases(lambda rng: (rng.randint(2, 5), rng.randint(2, 4)), 2, shown=MESHES)
    for pp, dp in [*MESHES, *drawn]:
        calls = {rank: _groups_of(make_groups, rank, pp, dp) for rank in range(pp * dp)}
        created = {rank: c for rank, (c, _) in calls.items()}
        differ = [rank for rank in created if created[rank] != created[0]]
        _check(not differ, f"pp={pp}, dp={dp}: rank 0 creates the groups {created[0]}, rank "
               f"{differ[0] if differ else 0} creates {created[differ[0]] if differ else ''}."
               f" dist.new_group is collective: every rank must create every group, its own "
               f"and the others', in the same order, or the job waits forever")
        for rank, (_, returned) in calls.items():
            replica, pipe_rank = divmod(rank, pp)
            want_pipe = tuple(replica * pp + p for p in range(pp))
            want_data = tuple(d * pp + pipe_rank for d in range(dp))
            _check(isinstance(returned, tuple) and len(returned) == 2
                   and all(isinstance(g, FakeGroup) for g in returned),
                   f"make_groups must return (pipeline_group, data_group), two groups made "
                   f"by dist.new_group; rank {rank} returned {returned!r}")
            pipe, data = returned
            _check(pipe.ranks == want_pipe,
                   f"pp={pp}, dp={dp}: rank {rank} (replica {replica}, pipe rank "
                   f"{pipe_rank}) got the pipeline group {list(pipe.ranks)}, not the ranks "
                   f"of its replica's pipeline (global rank = replica × pp + pipe rank, "
                   f"pipeline neighbours adjacent)")
            _check(data.ranks == want_data,
                   f"pp={pp}, dp={dp}: rank {rank} (replica {replica}, pipe rank "
                   f"{pipe_rank}) got the data-parallel group {list(data.ranks)}, not the "
                   f"ranks that hold its stage (the same pipe rank in every replica)")


if __name__ == "__main__":       # torchrun -m pipeline_lib.course.checks.nb06 MODULE OUT
    send_recv_worker(sys.argv[1], Path(sys.argv[2]))
