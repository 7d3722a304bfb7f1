"""The distributed transport's choices, with ``torch.distributed`` faked in this process:
what NCCL gets (no host wait per message, a step's end that names a message that never
came, no int16, no single hardware queue), and layouts agreed once per batch shape."""
from __future__ import annotations

import time

import pytest
import torch

from pipeline_lib.distributed import p2p
from pipeline_lib.distributed.p2p import PostedEarly, ProtocolError, encode
from pipeline_lib.lowering import Message, lower
from pipeline_lib.schedules import gpipe


class FakeMesh:
    pp, dp, replica, device = 2, 1, 0, torch.device("cpu")

    def __init__(self, pipe_rank: int, timeout: float = 60.0):
        self.rank = self.pipe_rank = pipe_rank
        self.timeout = timeout

    def global_rank(self, pipe_rank: int) -> int:
        return pipe_rank

    def channel(self, src: int, dst: int) -> tuple[str, int, int]:
        return ("channel", src, dst)


class FakeWork:
    """A send, which completes at once, or a receive, which never does (its peer is
    stalled); records how it was waited for."""

    def __init__(self, log: list, what: str):
        self.log, self.what = log, what

    def wait(self, *args):
        self.log.append((self.what, "wait", args))

    def is_completed(self) -> bool:
        self.log.append((self.what, "is_completed"))
        return self.what == "isend"


@pytest.fixture
def nccl(monkeypatch):
    """``torch.distributed`` on NCCL, faked: returns the log of sends and receives."""
    log: list = []
    monkeypatch.setattr(p2p.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(p2p.dist, "isend", lambda t, dst, group: (
        log.append(("isend", tuple(t.shape), t.dtype)) or FakeWork(log, "isend")))
    monkeypatch.setattr(p2p.dist, "irecv", lambda t, src, group: (
        log.append(("irecv", tuple(t.shape), t.dtype)) or FakeWork(log, "irecv")))
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    return log


def no_host_reads(monkeypatch):
    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, name=name: pytest.fail(
            f"a host read ({name}) during a step of known shapes"))


LOWERED = lower(gpipe(2, 2))            # rank 0 sends rank 1 two activations, and back
ACTIVATION = Message("activation", 1, 0, 0)


def known(transport: PostedEarly, key: int, value) -> None:
    """As if a step with batch ``key`` had agreed ``value``'s layout for every message."""
    transport.layouts[key] = {m: encode(m, value)[0] for m in
                              LOWERED.channel(0, 1) + LOWERED.channel(1, 0)}


def test_on_nccl_a_receive_makes_the_stream_wait_and_the_step_end_names_what_never_came(
        nccl, monkeypatch):
    """A step of known shapes: the receive allocates from the agreed layout, queues one
    receive (no header) and makes the current stream wait for it (``work.wait()``, no
    host wait, no host read); at the step's end the host asks, without waiting for any
    kernel, until the timeout, then names the rank, the message, the peer and the action
    that needed it."""
    transport = PostedEarly(FakeMesh(1, timeout=0.3), LOWERED)
    assert transport.ahead == 0   # NCCL: receives are queued at the action needing them
    known(transport, 7, torch.zeros(3, 4))
    transport.start_step(7)
    assert nccl == []
    with monkeypatch.context() as step:
        no_host_reads(step)
        value = transport.receive(0, ACTIVATION)
    assert value.shape == (3, 4)
    assert nccl == [("irecv", (3, 4), torch.float32), ("irecv", "wait", ())]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.3 s") as error:
        transport.finish_step()
    assert time.monotonic() - start < 2
    assert error.value.__notes__ == [
        "rank 1 was receiving the activation for stage 1, micro-batch 0 from rank 0, which "
        "1F0 needs (waits time out after 0.3 s)"]
    assert all(entry[1] != "wait" for entry in nccl[2:])   # asked, never waited on


def test_a_step_of_known_shapes_sends_only_the_tensors_and_checks_their_layout(nccl):
    """A batch's first step sends each message's header; the next with the same batch
    key, only the tensors, after checking that their layout is the one agreed; one with
    other shapes, and one with the first shapes again (remembered), likewise."""
    transport = PostedEarly(FakeMesh(0), LOWERED)
    sent = []
    for key, value in [(1, torch.zeros(3, 4)), (1, torch.ones(3, 4)), (2, torch.zeros(5, 4)),
                       (1, torch.ones(3, 4))]:
        nccl.clear()
        transport.start_step(key)
        transport.send(1, ACTIVATION, value)
        sent.append([entry[1:] for entry in nccl if entry[0] == "isend"])
        transport.finish_step()
    header = ((p2p.HEADER_SLOTS,), torch.int64)
    assert sent == [[header, ((3, 4), torch.float32)], [((3, 4), torch.float32)],
                    [header, ((5, 4), torch.float32)], [((3, 4), torch.float32)]]
    transport.start_step(1)
    with pytest.raises(ProtocolError, match="the activation for stage 1, micro-batch 0 is "
                                            r"float32\[3, 5\] in this step but was "
                                            r"float32\[3, 4\] in the last one"):
        transport.send(1, ACTIVATION, torch.ones(3, 5))


def test_nccl_refuses_int16_before_sending_anything(nccl):
    transport = PostedEarly(FakeMesh(0), LOWERED)
    transport.start_step(1)
    with pytest.raises(TypeError, match=r"a torch.int16 tensor \(NCCL has no such type\)"):
        transport.send(1, ACTIVATION, torch.zeros(3, dtype=torch.int16))
    assert nccl == []
    layout, _ = encode(ACTIVATION, torch.zeros(3, dtype=torch.int16))   # gloo has it
    assert layout.header[5] == 1


def test_nccl_refuses_a_single_hardware_queue(nccl, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        PostedEarly(FakeMesh(0), LOWERED)
