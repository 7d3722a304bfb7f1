"""Schedules in PyTorch's notation: per-rank lists of action strings, and the CSV files
that PyTorch's runtime loads (``_PipelineScheduleRuntime._load_csv``) and torchtitan takes
(``[parallelism] pipeline_parallel_schedule_csv``).

``torch.distributed.pipelining`` writes an action as we do, ``{stage}{kind}{micro-batch}``:
``2F0``, ``0B1``, and the split backward ``1I3``, ``1W3``. Its lowered programs add
``0SEND_F1``, ``1RECV_F1``, ``1SEND_B0``, ``0RECV_B0`` (a forward's output to the next stage,
an input gradient to the previous one), the bookkeeping ``0UNSHARD``, ``0RESHARD``,
``0REDUCE_GRAD`` (FSDP's gather and free; the gradient reduction and the division by the
number of micro-batches after a stage's last backward), and DualPipeV's overlapped pair
``(0F7;7B3)OVERLAP_F_B``: a forward and a backward of two stages run as one step, so that
one's communication hides under the other's compute. A CSV holds one row per rank, one
action per cell, no header; an empty cell is an idle step.

This module is plain text both ways: it imports none of PyTorch's private API, so a
schedule written here runs there, and one written there is read here and then validated,
simulated and drawn like ours (`Schedule.from_csv`).

* `to_pytorch` / `Schedule.to_pytorch`: our `Schedule` as PyTorch's per-rank lists;
  DualPipeV's pairs (``meta["overlapped"]``) written as PyTorch writes them.
* `comms_rows`: our lowering (`pipeline_lib.lowering`) as a ``compute_comms`` program, the
  receives where PyTorch's runtime needs them; `check_messages` checks any such program.
* `write_csv`, `to_csv` / `Schedule.to_csv`: either as a CSV file.
* `parse`, `read_csv`, `from_rows`, `from_csv` / `Schedule.from_csv`, `from_pytorch`:
  PyTorch's notation back to a validated `Schedule`, whatever produced it (PyTorch's
  ``_dump_csv``, torchtitan's assets, a spreadsheet, PyTorch's builders).
* `torchtitan_config`: the config lines that make torchtitan run an exported file.
"""
from __future__ import annotations

import csv
import re
from collections import deque
from pathlib import Path
from typing import Iterable, Literal, NamedTuple, Sequence, Union

from pipeline_lib.distributed.p2p import AHEAD
from pipeline_lib.lowering import LoweredSchedule, Receive, lower
from pipeline_lib.lowering import Message as LoweredMessage
from pipeline_lib.schedules import Action, Schedule, ScheduleError, v_shape, validate

Format = Literal["compute_only", "compute_comms"]
FORMATS: tuple[str, ...] = ("compute_only", "compute_comms")
MESSAGE_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
BOOKKEEPING_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
OVERLAP = "OVERLAP_F_B"


class Message(NamedTuple):
    """A send or a receive in a lowered program: ``0SEND_F1`` sends stage 0's forward
    output of micro-batch 1 (to stage 1's rank), ``1RECV_F1`` receives it for stage 1;
    ``1SEND_B0`` sends stage 1's input gradient (to stage 0's rank), ``0RECV_B0`` receives
    it. The stage is always the one on the rank that runs the action."""

    stage: int
    kind: str            # one of MESSAGE_KINDS
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


class Bookkeeping(NamedTuple):
    """``UNSHARD``, ``RESHARD`` or ``REDUCE_GRAD`` of a stage: no micro-batch."""

    stage: int
    kind: str            # one of BOOKKEEPING_KINDS

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}"


class Overlapped(NamedTuple):
    """Compute actions PyTorch runs as one step (DualPipeV: a forward, then a backward of
    another stage), written ``(0F7;7B3)OVERLAP_F_B``."""

    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return f"({';'.join(map(str, self.actions))}){OVERLAP}"


Token = Union[Action, Message, Bookkeeping, Overlapped]

_COMPUTE = re.compile(r"(\d+)([FBIW])(\d+)")
_MESSAGE = re.compile(rf"(\d+)({'|'.join(MESSAGE_KINDS)})(\d+)")
_BOOKKEEPING = re.compile(rf"(\d+)({'|'.join(BOOKKEEPING_KINDS)})")
_OVERLAPPED = re.compile(rf"\((.*)\){OVERLAP}")
_FORMS = ("compute 2F0, 0B1, 1I3, 1W3; messages 0SEND_F1, 1RECV_F1, 1SEND_B0, 0RECV_B0; "
          "0UNSHARD, 0RESHARD, 0REDUCE_GRAD; or a pair (0F7;7B3)OVERLAP_F_B")


def parse(text: str) -> Token | None:
    """One cell of PyTorch's notation; None for an empty (idle) cell.

    Stricter than PyTorch's own reader, which takes the longest valid prefix (``0F1x``
    is ``0F1`` there): a cell is one action, whole, or an error that says which forms
    exist."""
    text = text.strip()
    if not text:
        return None
    if match := _COMPUTE.fullmatch(text):
        return Action(int(match[1]), match[2], int(match[3]))
    if match := _MESSAGE.fullmatch(text):
        return Message(int(match[1]), match[2], int(match[3]))
    if match := _BOOKKEEPING.fullmatch(text):
        return Bookkeeping(int(match[1]), match[2])
    if match := _OVERLAPPED.fullmatch(text):
        parts = [parse(part) for part in match[1].split(";")]
        if len(parts) < 2 or not all(isinstance(p, Action) for p in parts):
            raise ValueError(f"{text!r}: an overlapped step holds two or more compute "
                             f"actions, e.g. (0F7;7B3)OVERLAP_F_B")
        return Overlapped(tuple(parts))
    raise ValueError(f"{text!r} is not an action in PyTorch's notation: {_FORMS}")


def compute_actions(token: Token | None) -> tuple[Action, ...]:
    """The compute actions a token runs: itself, an overlapped pair's parts, or none."""
    if isinstance(token, Action):
        return (token,)
    if isinstance(token, Overlapped):
        return token.actions
    return ()


# -- ours to PyTorch's ----------------------------------------------------------------------

def pytorch_tokens(schedule: Schedule, overlap: bool = True) -> list[list[Action | Overlapped]]:
    """Each rank's program as PyTorch's compute tokens. With ``overlap``, a pair recorded
    in ``schedule.meta["overlapped"]`` (DualPipeV's F&B steps) whose actions follow each
    other in the program becomes one `Overlapped` step, as PyTorch's ScheduleDualPipeV
    writes it; PyTorch's runtime then runs its two actions one after the other, as ours
    does, so the order of the computations is the same either way."""
    pairs = {group[0]: tuple(group) for group in schedule.meta.get("overlapped", ())} \
        if overlap else {}
    rows = []
    for program in schedule.actions:
        row: list[Action | Overlapped] = []
        k = 0
        while k < len(program):
            group = pairs.get(program[k])
            if group and tuple(program[k:k + len(group)]) == group:
                row.append(Overlapped(group))
                k += len(group)
            else:
                row.append(program[k])
                k += 1
        rows.append(row)
    return rows


def to_pytorch(schedule: Schedule, overlap: bool = True) -> list[list[str]]:
    """Per rank, the program as PyTorch's action strings (``["0F0", "0F1", "0B0", ...]``),
    validated first: what PyTorch's ``_Action.from_str`` reads, and what a
    ``compute_only`` CSV holds row by row. See `pytorch_tokens` for ``overlap``."""
    validate(schedule)
    return [[str(token) for token in row] for row in pytorch_tokens(schedule, overlap)]


def write_csv(rows: Sequence[Sequence[object]], path: str | Path) -> Path:
    """``rows`` (one per rank, each cell an action or its string) as a CSV, one row per
    rank, no header: the file ``_load_csv`` and torchtitan read."""
    path = Path(path)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        for row in rows:
            writer.writerow([str(cell) for cell in row])
    return path


# -- PyTorch's to ours ----------------------------------------------------------------------

def read_csv(path: str | Path) -> list[list[Token]]:
    """A schedule CSV in PyTorch's notation, one list of tokens per row (rank), empty
    (idle) cells dropped; a cell that is not an action raises, naming its row and column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no schedule CSV at {path}")
    rows = []
    # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte-order mark, not an action
    with path.open(newline="", encoding="utf-8-sig") as file:
        try:
            lines = list(csv.reader(file))
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} is not UTF-8 text (byte {error.start}): a schedule CSV "
                             f"is plain text, one row of actions per rank; save it as CSV "
                             f"(UTF-8)") from None
    for rank, row in enumerate(lines):
        tokens = []
        for column, cell in enumerate(row):
            try:
                token = parse(cell)
            except ValueError as error:
                raise ValueError(f"{path.name}, row {rank} (rank {rank}), column "
                                 f"{column}: {error}") from None
            if token is not None:
                tokens.append(token)
        rows.append(tokens)
    if not rows:
        raise ValueError(f"{path} is empty: a schedule CSV has one row of actions per rank")
    return rows


def csv_format(rows: Iterable[Sequence[Token]]) -> Format:
    """``compute_comms`` if any row holds a send, a receive or bookkeeping, which a
    ``compute_only`` file must not (PyTorch refuses it there)."""
    lowered = any(isinstance(t, (Message, Bookkeeping)) for row in rows for t in row)
    return "compute_comms" if lowered else "compute_only"


def from_rows(rows: Sequence[Sequence[Token | str]], name: str = "PyTorch",
              microbatches: int | None = None, check: bool = True) -> Schedule:
    """A `Schedule` from PyTorch's per-rank programs (tokens or their strings), validated
    unless ``check`` is False.

    The compute actions are kept in order, an overlapped step's parts one after the other
    (its groups recorded in ``meta["overlapped"]``); sends, receives and bookkeeping are
    dropped, as our lowering derives the messages from the compute order again. Sizes are
    read off the actions: the ranks are the rows, the stages and micro-batches the largest
    indices plus one (unless ``microbatches`` says), each stage's rank is where its
    actions run; if that is ``s % ranks`` for every stage the placement is looped, else
    it is kept (ZB-V's and DualPipeV's V). Every rank must hold as many stages."""
    tokens = [[parse(t) if isinstance(t, str) else t for t in row] for row in rows]
    actions = [[a for t in row for a in compute_actions(t)] for row in tokens]
    overlapped = [t.actions for row in tokens for t in row if isinstance(t, Overlapped)]
    ranks = len(actions)
    found = [a for program in actions for a in program]
    if ranks == 0 or not found:
        raise ScheduleError(f"{name}: no compute actions (F, B, I, W) in {ranks} rows")
    where: dict[int, int] = {}
    for rank, program in enumerate(actions):
        for a in program:
            if where.setdefault(a.stage, rank) != rank:
                raise ScheduleError(f"{name}: stage {a.stage} has actions on rank "
                                    f"{where[a.stage]} and on rank {rank} ({a}); a stage "
                                    f"lives on one rank")
    stages = max(where) + 1
    empty = [s for s in range(stages) if s not in where]
    if empty:
        raise ScheduleError(f"{name}: stages {empty} have no actions (stages 0..{stages - 1} "
                            f"are counted from the largest index)")
    idle = [r for r in range(ranks) if r not in where.values()]
    if idle or stages % ranks:
        raise ScheduleError(f"{name}: {stages} stages on {ranks} ranks"
                            + (f", none on ranks {idle}" if idle else "")
                            + "; a Schedule puts as many stages on every rank")
    if microbatches is None:
        microbatches = max(a.microbatch for a in found) + 1
    placement = tuple(where[s] for s in range(stages))
    schedule = Schedule(name, ranks, microbatches, actions, virtual_stages=stages // ranks,
                        placement=None if placement == tuple(s % ranks for s in range(stages))
                        else placement,
                        meta={"overlapped": overlapped} if overlapped else {})
    if check:
        validate(schedule)
    return schedule


def from_csv(path: str | Path, name: str | None = None,
             microbatches: int | None = None) -> Schedule:
    """`read_csv`, then `from_rows`: a PyTorch or torchtitan schedule CSV, ``compute_only``
    or ``compute_comms``, as our validated `Schedule`, named after the file. In a
    ``compute_comms`` file the messages are checked too (`check_messages`)."""
    path = Path(path)
    rows = read_csv(path)
    schedule = from_rows(rows, name or path.stem, microbatches)
    if csv_format(rows) == "compute_comms":
        check_messages(rows, schedule)
    return schedule


def from_pytorch(ops: Sequence[Sequence[object]], name: str = "PyTorch",
                 microbatches: int | None = None) -> Schedule:
    """PyTorch's per-rank lists of ``_Action`` (a schedule's ``pipeline_order``, the
    visualiser's ``get_schedule_ops``; ``None`` for an idle step) as our `Schedule`, each
    action through its string, which PyTorch writes in this module's notation. Not
    validated: PyTorch's own lists can be wrong (its single-stage 1F1B's is, see
    `pipeline_lib.course.pytorch_schedules`); call `validate`."""
    return from_rows([["" if op is None else str(op) for op in row] for row in ops],
                     name, microbatches, check=False)


def comms_rows(lowered: LoweredSchedule | Schedule, overlap: bool = True,
               ahead: int = AHEAD) -> list[list[str]]:
    """Each rank's program of our lowering (`lowering.lower`, given or done here) in
    PyTorch's ``compute_comms`` notation, as its runtime needs it:

    * the messages between ranks, ``SEND_*`` right after the action that produces one;
      those between two stages of one rank (a V's turn) left out, as PyTorch hands them
      over in memory too;
    * the ``RECV_*`` of every link **in the order the sender sends**: PyTorch's runtime
      sends every message with the same tag, and gloo and NCCL match a link's receives to
      its sends by order, so a receive posted out of turn would get another message (the
      same shape, as often as not: silently wrong gradients). Our lowering puts each
      receive right before the action that consumes it, which can differ from the link's
      order (interleaved schedules);
    * and **early**: a message's transfer completes only once its receive is posted, and
      the runtime waits only where an action needs it, so, as our own transport does
      (`distributed.p2p.AHEAD`),
      ``ahead`` receives of each link are posted from the start and topped up after each
      action that consumed one, and more where an action needs them; PyTorch's own
      lowering posts a receive when the sender sends, to the same effect. A rank then
      always has the next message of every link posted before it sends anything;
    * ``REDUCE_GRAD`` after each stage's last backward: the runtime divides the stage's
      gradients by the number of micro-batches there, and nowhere else;
    * DualPipeV's recorded pairs (``overlap``) as one ``OVERLAP_F_B`` step, the receives of
      both before it and the sends of both after.

    Skip connections have no place in PyTorch's notation (a ``SEND_F`` goes to the next
    stage) and its runtime refuses them: a lowering with skip routes is refused."""
    if isinstance(lowered, Schedule):
        lowered = lower(lowered)
    if lowered.routes:
        raise ValueError(f"{lowered.schedule.name}: skip connections "
                         f"({', '.join(sorted({r.key[1] for r in lowered.routes}))}) have no "
                         f"place in PyTorch's notation, where a forward's output goes to the "
                         f"next stage only, and its runtime refuses them; run them with our "
                         f"executors")
    if ahead < 1:
        raise ValueError(f"ahead={ahead}: keep at least one receive of each link posted")
    schedule = lowered.schedule
    last_backward = {}
    for program in schedule.actions:
        for a in program:
            if a.kind in ("B", "W"):
                last_backward[a.stage] = a
    rows = []
    for rank, tokens in enumerate(pytorch_tokens(schedule, overlap)):
        steps = {step.action: step for step in lowered.programs[rank]}
        links = {peer: deque(lowered.channel(peer, rank)) for peer in range(lowered.ranks)
                 if peer != rank}
        outstanding = dict.fromkeys(links, 0)       # posted, not yet consumed
        posted: set[LoweredMessage] = set()
        row: list[str] = []

        def post(peer: int, until: LoweredMessage | None = None) -> None:
            """Post the link's next receives: up to ``until``, or up to ``ahead``."""
            while links[peer] and (until not in posted if until is not None
                                   else outstanding[peer] < ahead):
                message = links[peer].popleft()
                posted.add(message)
                outstanding[peer] += 1
                row.append(str(Receive(peer, message, False)))

        for peer in links:
            post(peer)
        for token in tokens:
            mine = [steps[a] for a in compute_actions(token)]
            needed = [r for step in mine for r in step.receives if not r.local]
            for receive in needed:
                post(receive.peer, receive.message)
            row.append(str(token))
            for receive in needed:
                outstanding[receive.peer] -= 1
            for peer in dict.fromkeys(r.peer for r in needed):
                post(peer)
            for step in mine:
                row += [str(send) for send in step.sends if not send.local]
                if last_backward.get(step.action.stage) == step.action:
                    row.append(str(Bookkeeping(step.action.stage, "REDUCE_GRAD")))
        rows.append(row)
    return rows


_MESSAGE_OF = {   # PyTorch's message action -> (our kind, consuming stage, producing stage)
    "SEND_F": ("activation", 1, 0), "RECV_F": ("activation", 0, -1),
    "SEND_B": ("gradient", -1, 0), "RECV_B": ("gradient", 0, 1)}


def lowered_message(token: Message) -> LoweredMessage:
    """The message of our lowering that PyTorch's ``SEND_*``/``RECV_*`` token names."""
    kind, to, source = _MESSAGE_OF[token.kind]
    return LoweredMessage(kind, token.stage + to, token.microbatch, token.stage + source)


def check_messages(rows: Sequence[Sequence[Token]], schedule: Schedule) -> None:
    """A ``compute_comms`` program (``rows``, whose compute order is ``schedule``) carries
    what our lowering says, where PyTorch's runtime needs it; raises `ScheduleError`
    naming the rank, column and action otherwise. PyTorch checks none of it before it
    runs (a missing receive fails mid-step, a misordered one can pass silently):

    * every message between ranks sent once, after the action that produces it, and
      received once, before the action that consumes it, by the ranks our lowering names;
    * on every link, the receives in the order of the sends (see `comms_rows`)."""
    lowered = lower(schedule)
    sends = [{} for _ in rows]        # rank -> message -> column
    receives = [{} for _ in rows]
    for rank, row in enumerate(rows):
        done: set[Action] = set()
        want = {s.message: s for step in lowered.programs[rank] for s in step.sends
                if not s.local}
        expect = {r.message: r for step in lowered.programs[rank] for r in step.receives
                  if not r.local}
        waits = {step.action: [r.message for r in step.receives if not r.local]
                 for step in lowered.programs[rank]}
        for column, token in enumerate(row):
            where = f"{schedule.name}: rank {rank}, column {column}: {token}"
            if isinstance(token, Message):
                message = lowered_message(token)
                table, wanted = (sends, want) if token.kind.startswith("SEND") else \
                    (receives, expect)
                if message not in wanted:
                    raise ScheduleError(f"{where} is not a message rank {rank} "
                                        + ("sends" if table is sends else "receives")
                                        + f" in this schedule ({message})")
                if message in table[rank]:
                    raise ScheduleError(f"{where} appears twice (also column "
                                        f"{table[rank][message]})")
                kinds = "F" if message.kind == "activation" else "IB"
                if table is sends and not any(Action(message.source, kind, message.microbatch)
                                              in done for kind in kinds):
                    raise ScheduleError(f"{where} sends before {_producer(message, schedule)} "
                                        f"computes it")
                table[rank][message] = column
            for a in compute_actions(token):
                missing = [m for m in waits[a] if m not in receives[rank]]
                if missing:
                    raise ScheduleError(f"{where} runs before it receives {missing[0]}: put "
                                        f"its RECV before it")
                done.add(a)
        for table, wanted, verb in ((sends, want, "send"), (receives, expect, "receive")):
            absent = [m for m in wanted if m not in table[rank]]
            if absent:
                raise ScheduleError(f"{schedule.name}: rank {rank} does not {verb} "
                                    f"{absent[0]}" + (f" ({len(absent)} in all)"
                                                      if len(absent) > 1 else ""))
    for src, dst in lowered.pairs():
        sent = sorted(lowered.channel(src, dst), key=lambda m: sends[src][m])
        got = sorted(sent, key=lambda m: receives[dst][m])
        if sent != got:
            k = next(k for k, (a, b) in enumerate(zip(sent, got)) if a != b)
            raise ScheduleError(f"{schedule.name}: rank {dst} receives from rank {src} "
                                f"{got[k]} where rank {src} sends {sent[k]}: a link matches "
                                f"receives to sends by order, so post rank {dst}'s receives "
                                f"from rank {src} in the order rank {src} sends")


def _producer(message: LoweredMessage, schedule: Schedule) -> Action:
    """The action whose output ``message`` is: a forward, or the backward (I if split)."""
    if message.kind == "activation":
        return Action(message.source, "F", message.microbatch)
    split = any(a == Action(message.source, "I", message.microbatch)
                for a in schedule.actions[schedule.rank_of(message.source)])
    return Action(message.source, "I" if split else "B", message.microbatch)


def to_csv(schedule: Schedule, path: str | Path, format: Format = "compute_only",
           overlap: bool = True) -> Path:
    """`Schedule.to_csv`: ``compute_only`` rows are `to_pytorch`'s; ``compute_comms`` rows
    add the messages of our lowering (`comms_rows`)."""
    if format == "compute_only":
        return write_csv(to_pytorch(schedule, overlap), path)
    if format == "compute_comms":
        return write_csv(comms_rows(schedule, overlap), path)
    raise ValueError(f"format={format!r}: PyTorch's CSV formats are {FORMATS}")


def torchtitan_config(schedule: Schedule, csv: str | Path, microbatch_size: int = 1) -> str:
    """The lines of a torchtitan TOML config that run ``schedule`` from its ``compute_only``
    CSV at ``csv`` (`Schedule.to_csv`).

    torchtitan (``torchtitan/distributed/pipeline_parallel.py``) takes the file from
    ``pipeline_parallel_schedule_csv``, runs it on ``_PipelineScheduleRuntime`` and loads
    it with ``_load_csv``'s default format, ``compute_only``; but it cuts and places the
    stages by ``pipeline_parallel_schedule``, a PyTorch schedule's name: one stage per rank
    for a single-stage one ("1F1B"), two per rank by default for a multi-stage one, looped
    ("Interleaved1F1B") or in a V ("ZBVZeroBubble"). So the name is chosen here for the
    placement only; a looped schedule with other than 2 stages per rank also needs
    ``pipeline_parallel_layers_per_stage`` (stated in a comment), and a placement that is
    neither looped nor a V cannot be expressed. The micro-batches are
    ``local_batch_size // pipeline_parallel_microbatch_size``."""
    v, p = schedule.virtual_stages, schedule.ranks
    if schedule.placement is None:
        name = "1F1B" if v == 1 else "Interleaved1F1B"
        where = "one stage per rank" if v == 1 else f"{v} stages per rank, looped"
    elif schedule.placement == v_shape(p):
        name, where = "ZBVZeroBubble", "2 stages per rank, in a V"
    else:
        raise ValueError(f"{schedule.name}: torchtitan places stages looped or in a V, not as "
                         f"{list(schedule.placement)}")
    extra = "" if v <= 2 else (f"# and pipeline_parallel_layers_per_stage such that the model "
                               f"makes {p * v} stages\n")
    return (f"[parallelism]\n"
            f"pipeline_parallel_degree = {p}\n"
            f'pipeline_parallel_schedule = "{name}"   # only for the placement: {where}\n'
            f'pipeline_parallel_schedule_csv = "{csv}"\n'
            f"pipeline_parallel_microbatch_size = {microbatch_size}\n{extra}"
            f"\n[training]\n"
            f"local_batch_size = {schedule.microbatches * microbatch_size}   # "
            f"{schedule.microbatches} micro-batches of {microbatch_size}\n")
