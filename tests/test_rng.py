"""The two ways of giving a micro-batch its random stream draw the same numbers."""
import threading
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from pipeline_lib import rng
from pipeline_lib.rng import microbatch_rng, owned_rng


def draws() -> list[torch.Tensor]:
    x = torch.ones(64)
    return [F.dropout(x, 0.5), F.rrelu(-x, training=True), torch.empty(3).uniform_(),
            torch.rand(3), torch.randn(2, 2), torch.randint(0, 9, (4,))]


def test_owned_rng_draws_what_microbatch_rng_draws_and_replays():
    torch.manual_seed(123)
    with microbatch_rng(7):
        private = draws()
    for _ in range(2):   # entering again with the same seed replays
        with owned_rng(7):
            owned = draws()
        assert all(torch.equal(a, b) for a, b in zip(private, owned))
    with owned_rng(8):
        other = draws()
    assert not torch.equal(private[1], other[1])


def test_owned_rng_leaves_the_global_generator_as_it_was():
    torch.manual_seed(0)
    expected = torch.rand(5)
    torch.manual_seed(0)
    with owned_rng(7):
        torch.rand(100)
    assert torch.equal(torch.rand(5), expected)


def run_while_locked(work: Callable[[], None]) -> None:
    """Run ``work`` on another thread while this one holds the streams' lock."""
    with rng._LOCK:
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), f"{work.__name__} waited for the stream lock"


def test_cpu_dropout_matches_pytorch_and_takes_no_lock():
    """Stage threads draw CPU dropout masks at the same time: with the lock held
    elsewhere, a stream still draws, and draws what PyTorch's own dropout would."""
    x = torch.randn(8, 16)
    with owned_rng(3):
        expected = [F.dropout(x.clone(), 0.3, True, inplace) for inplace in (False, True)]
    result: list[torch.Tensor] = []

    def draw() -> None:
        with microbatch_rng(3):
            result.extend(F.dropout(x.clone(), 0.3, True, inplace) for inplace in (False, True))

    run_while_locked(draw)
    assert len(result) == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, result))


def test_dropout_in_evaluation_draws_nothing_and_takes_no_lock():
    x = torch.randn(8, 16)
    outputs: list[torch.Tensor] = []

    def evaluate() -> None:
        with microbatch_rng(3):
            outputs.append(F.dropout(x, 0.3, training=False))
            outputs.append(F.dropout(x, 0.0))

    run_while_locked(evaluate)
    assert len(outputs) == 2 and all(torch.equal(o, x) for o in outputs)


def test_attention_dropout_matches_pytorch_and_takes_no_lock():
    """An attention with dropout draws its mask inside `F.multi_head_attention_forward`
    (in scaled_dot_product_attention, or on the returned weights); its projections and
    its mask run while another stage thread holds the lock."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
    x = torch.randn(3, 5, 16)

    def attend() -> list[torch.Tensor]:
        return [attention(x, x, x, need_weights=weights)[0] for weights in (False, True)]

    with owned_rng(4):
        expected = attend()
    result: list[torch.Tensor] = []

    def attend_on_stream() -> None:
        with microbatch_rng(4):
            result.extend(attend())

    run_while_locked(attend_on_stream)
    assert len(result) == 2 and all(torch.equal(a, b) for a, b in zip(expected, result))
    assert not torch.equal(expected[0], attend()[0])


def test_a_kernel_without_a_generator_draws_under_the_lock():
    """``torch.rand``'s kernel takes no generator: it waits for the lock, then draws from
    the stream what the process-wide generator would."""
    with owned_rng(5):
        expected = torch.rand(4)
    result: list[torch.Tensor] = []

    def draw() -> None:
        with microbatch_rng(5):
            result.append(torch.rand(4))

    with rng._LOCK:
        thread = threading.Thread(target=draw, daemon=True)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive() and not result, "torch.rand did not wait for the lock"
    thread.join(timeout=10)
    assert len(result) == 1 and torch.equal(result[0], expected)


def test_threads_drawing_at_once_each_get_their_own_stream():
    seeds = range(4)
    expected = {}
    for seed in seeds:
        with owned_rng(seed):
            expected[seed] = [draws() for _ in range(5)]
    results: dict[int, list] = {}
    start = threading.Barrier(len(seeds))

    def work(seed: int) -> None:
        start.wait()
        with microbatch_rng(seed):
            results[seed] = [draws() for _ in range(5)]

    threads = [threading.Thread(target=work, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for seed in seeds:
        for got, want in zip(results[seed], expected[seed]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_explicit_generator_is_left_alone():
    expected = torch.rand(3, generator=torch.Generator().manual_seed(9))
    with microbatch_rng(1):
        drawn = torch.rand(3, generator=torch.Generator().manual_seed(9))
    assert torch.equal(drawn, expected)


def test_a_draw_on_a_device_the_stage_does_not_own_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"a random kernel ran on meta, not on its "
                                           r"stage's devices \['cpu'\]"):
        with microbatch_rng(1):
            torch.empty(3, device="meta").uniform_()


def test_owned_rng_seeds_the_current_gpu_for_an_index_less_cuda(monkeypatch):
    """"cuda" means the current GPU (here GPU 1, faked by CPU generators): its generator is
    seeded for the block and restored after it; GPU 0's is left alone."""
    gpus = (torch.Generator().manual_seed(10), torch.Generator().manual_seed(11))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "default_generators", gpus, raising=False)
    before = [g.get_state() for g in gpus]
    with owned_rng(7, "cuda"):
        assert gpus[1].initial_seed() == 7
        assert torch.equal(gpus[0].get_state(), before[0])
    assert all(torch.equal(g.get_state(), state) for g, state in zip(gpus, before))


# -- shared_rng: the stream swapped in by the layers that draw ----------------------------

class DrawsItself(torch.nn.Module):
    """Draws in its own forward (around a dropout layer of its own): the whole layer
    runs with the stream swapped in."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.3))

    def forward(self, x):
        return self.inner(F.dropout(x, 0.2)) + torch.rand_like(x)


class Attend(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


def stage_with_attention() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), Attend(),
                               torch.nn.RReLU(), DrawsItself())


def count_kernels_seen(monkeypatch) -> list[int]:
    seen = [0]
    dispatch = rng._Stream.__torch_dispatch__

    def counting(self, *args, **kwargs):
        seen[0] += 1
        return dispatch(self, *args, **kwargs)

    monkeypatch.setattr(rng._Stream, "__torch_dispatch__", counting)
    return seen


# A CPU stage gives its drawing layers the stream through the dispatch mode, without a
# lock; a GPU stage swaps the stream in under the lock. The stage device only picks the
# path: "cuda:1" (no GPU here) runs the swap on the CPU generator its layers draw from.
DEVICES = [torch.device("cpu"), torch.device("cuda", 1)]


@pytest.fixture(autouse=True)
def fake_gpu_generators(monkeypatch):
    """The two GPUs' generators, faked by CPU ones (nothing draws on them here)."""
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "default_generators",
                        tuple(torch.Generator().manual_seed(k) for k in range(2)), raising=False)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_shared_rng_draws_what_owned_rng_draws(device):
    """The first block of a stage finds the layers that draw (a dispatch mode sees each
    kernel); every block, first or not, replayed or not, draws what `owned_rng` draws."""
    module = stage_with_attention()
    x = torch.randn(3, 5, 16)
    expected = {}
    for seed in range(3):
        with owned_rng(seed):
            expected[seed] = module(x)
    for seed in (0, 1, 2, 0):
        with rng.shared_rng(seed, device, module):
            assert torch.equal(module(x), expected[seed]), seed
    found = [type(layer).__name__ for layer in module.modules() if layer in rng._draws]
    assert found == ["Dropout", "MultiheadAttention", "RReLU", "DrawsItself", "Dropout"]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_layers_that_do_not_draw_cost_nothing(monkeypatch, device):
    """After the first block, kernels are seen only inside layers that draw (on a CPU
    stage: a dropout's few), none on a GPU stage: ten more linear layers add none."""
    seen_in, x = {}, torch.randn(4, 16)
    for extra in (0, 10):
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(extra)],
                                     torch.nn.Dropout(0.5))
        with rng.shared_rng(0, device, module):
            module(x)
        seen = count_kernels_seen(monkeypatch)
        with rng.shared_rng(1, device, module):
            module(x)
        seen_in[extra] = seen[0]
    assert seen_in[0] == seen_in[10]
    assert 0 < seen_in[0] <= 6 if device.type == "cpu" else seen_in[0] == 0


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_the_lock_is_held_only_while_a_drawing_layer_runs_on_a_gpu_stage(device):
    module = stage_with_attention()
    held = {}

    def note(i: int) -> Callable[..., None]:
        def hook(layer, args, out) -> None:   # runs before the layer's own end hook
            held[i] = rng._LOCK.locked()
        return hook

    for i, layer in enumerate(module):
        layer.register_forward_hook(note(i))
    x = torch.randn(3, 5, 16)
    for seed in (0, 1):   # the first finds the layers, the second gives them the stream
        held.clear()
        with rng.shared_rng(seed, device, module):
            module(x)
    drawing = {0: False, 1: True, 2: False, 3: True, 4: True}   # 2: Attend, around it
    assert held == (drawing if device.type == "cuda" else dict.fromkeys(drawing, False))
    assert not rng._LOCK.locked()


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_stage_threads_drawing_at_once_get_their_streams(device):
    modules = [stage_with_attention() for _ in range(4)]
    x = torch.randn(3, 5, 16)
    expected = {}
    for seed, module in enumerate(modules):
        with owned_rng(seed):
            expected[seed] = [module(x) for _ in range(5)]
        with rng.shared_rng(seed, device, module):   # the first block of each stage
            module(x)
    results: dict[int, list] = {}
    start = threading.Barrier(len(modules))

    def work(seed: int) -> None:
        start.wait()
        with rng.shared_rng(seed, device, modules[seed]):
            results[seed] = [modules[seed](x) for _ in range(5)]

    threads = [threading.Thread(target=work, args=(s,)) for s in range(len(modules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for seed in expected:
        assert all(torch.equal(a, b) for a, b in zip(results[seed], expected[seed]))


class Sometimes(torch.nn.Module):
    """Draws only when told to: the first block cannot see it."""

    def __init__(self):
        super().__init__()
        self.draw = False

    def forward(self, x):
        return torch.rand_like(x) if self.draw else x


def test_a_draw_outside_the_layers_found_is_an_error_and_the_stage_is_examined_again():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), Sometimes())
    x = torch.randn(2, 4)
    with rng.shared_rng(1, "cpu", module):
        module(x)
    module[1].draw = True
    with pytest.raises(RuntimeError, match=r"drawn from the generator of cpu that stage "
                                           r"threads share, outside the layers .* examined "
                                           r"again"):
        with rng.shared_rng(1, "cpu", module):
            module(x)
    with owned_rng(1):
        expected = module(x)
    for _ in range(2):
        with rng.shared_rng(1, "cpu", module):
            assert torch.equal(module(x), expected)


def test_a_step_seed_drawn_by_another_thread_during_a_block_is_not_the_stages_draw():
    """Another thread's ``pipe(x)`` draws its step's seed from the global generator while
    a step's stage runs: that is not a draw of the stage, and the block goes on; a seed
    and a stray draw together still are one."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    x = torch.randn(2, 4)
    with rng.shared_rng(1, "cpu", module):          # the first block finds the dropout
        module(x)

    def elsewhere(stray: bool) -> None:
        thread = threading.Thread(target=lambda: [rng.new_step_seed() for _ in range(3)]
                                  + ([torch.rand(1)] if stray else []))
        thread.start()
        thread.join(timeout=30)

    with rng.shared_rng(1, "cpu", module):
        module(x)
        elsewhere(stray=False)
    with pytest.raises(RuntimeError, match="threads share, outside the layers"):
        with rng.shared_rng(1, "cpu", module):
            module(x)
            elsewhere(stray=True)


def test_a_stage_drawing_outside_its_layers_keeps_the_dispatch_mode(monkeypatch):
    """A loss_fn that draws (label smoothing by noise, say) runs in the stage's block
    but in no layer: no layer can swap the stream in, so every block sees each kernel,
    exact."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with owned_rng(2):
        expected = module(x) + torch.rand(2, 4)
    seen = count_kernels_seen(monkeypatch)
    for _ in range(2):
        before = seen[0]
        with rng.shared_rng(2, "cpu", module):
            assert torch.equal(module(x) + torch.rand(2, 4), expected)
        assert seen[0] > before


def test_a_drawing_layer_that_raises_gives_the_generator_and_the_lock_back():
    class Fails(torch.nn.Module):
        def forward(self, x):
            torch.rand(3)
            if self.fail:
                raise ValueError("boom")
            return x

    layer = Fails()
    layer.fail = False
    module = torch.nn.Sequential(layer)
    with rng.shared_rng(3, "cpu", module):
        module(torch.ones(1))
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    layer.fail = True
    with pytest.raises(ValueError, match="boom"):
        with rng.shared_rng(3, "cpu", module):
            module(torch.ones(1))
    assert not rng._LOCK.locked() and torch.equal(torch.rand(2), expected)
