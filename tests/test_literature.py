"""The simulator reproduces the published numbers of the frontier schedules.

DeepSeek-V3's technical report (2024), Table 2, with F a forward, B a full backward and W
its weight half (so the input half I = B - W), per stage:

    method    bubble                   parameters   activations (stage-micro-batches)
    1F1B      (PP-1)(F+B)              1x           PP
    ZB1P      (PP-1)(F+B-2W)           1x           PP
    DualPipe  (PP/2-1)(F&B+B-3W)       2x           PP+1

DualPipeV, the V on PP/2 ranks, is not in that report: DeepSeek's DualPipe repository
(deepseek-ai/DualPipe, README) gives it DualPipe's row on PP/2 devices.

and Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): ZB-H1's bubble is a third
of 1F1B's when F = I = W, ZB-H2 reaches zero with more memory, ZB-V has 1F1B's memory.

A bubble here is one rank's idle time in the step (`RankFacts.bubble`); every rank idles
as long in these schedules, with equal stages.
"""
import pytest

from pipeline_lib.schedules import dualpipe_v, one_f_one_b, zb_h1, zb_h2, zb_v
from pipeline_lib.timeline import rank_facts, simulate

# (F, I, W): the papers' F = I = W, and others with W <= F, where ZB-H1's formula holds
COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.5, 1.0, 1.0), (1.3, 1.2, 0.9), (2.0, 1.5, 1.0)]


def facts(schedule, f, i, w):
    return rank_facts(schedule, simulate(schedule, forward=f, backward=i + w, weight=w))


@pytest.mark.parametrize("PP", [2, 4, 6, 8])
@pytest.mark.parametrize("f,i,w", COSTS)
def test_deepseek_1f1b_and_zb1p(PP, f, i, w):
    b, m = i + w, 3 * PP
    one = facts(one_f_one_b(PP, m), f, i, w)
    zb = facts(zb_h1(PP, m), f, i, w)
    assert [r.bubble for r in one] == pytest.approx([(PP - 1) * (f + b)] * PP)
    assert [r.bubble for r in zb] == pytest.approx([(PP - 1) * (f + b - 2 * w)] * PP)
    for table in (one, zb):
        assert [r.parameters for r in table] == [1] * PP
        assert max(r.activations for r in table) == PP


@pytest.mark.parametrize("PP", [4, 6, 8, 12])
@pytest.mark.parametrize("f,i,w", [c for c in COSTS if c[2] <= c[1] <= c[0] <= c[1] + c[2]])
def test_deepseek_dualpipe_v_and_our_closed_form(PP, f, i, w):
    """DualPipeV (the DualPipe repository's row) runs DeepSeek's PP stages on PP/2 ranks,
    two each (a V), so F, I and W
    are a stage's here too. DeepSeek overlaps a forward with a backward (F&B); our
    executors run one action at a time, so F&B = F + B, and the table's bubble would be
    (PP/2-1)(F+2B-3W). Ours is (PP/2-1)(F+B-2W), ZB1P's per-hop bubble, one I per hop
    less: an overlapped pair starts when the inputs of both halves are there and sends
    both results when it ends, while F then B sends the forward's output before the B
    runs and starts the B when its gradient is there. This holds for W <= I <= F <= B,
    which includes F = I = W.

    Memory: our units are stages of a 1/(PP/2) share of the model, each holding two of
    DeepSeek's stages: 1 stage of parameters here is their 2x, (PP+1)/2 here their PP+1.
    """
    b, ranks = i + w, PP // 2
    dual = facts(dualpipe_v(ranks, 3 * PP), f, i, w)
    ours = (PP / 2 - 1) * (f + b - 2 * w)
    assert [r.bubble for r in dual] == pytest.approx([ours] * ranks)
    assert [2 * r.parameters for r in dual] == [2] * ranks
    assert [2 * r.activations for r in dual] == [PP + 1] * ranks


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_qi_zb_h1_bubble_is_a_third_of_1f1b_at_equal_costs(p):
    one, zb = facts(one_f_one_b(p, 2 * p), 1, 1, 1), facts(zb_h1(p, 2 * p), 1, 1, 1)
    assert [z.bubble / o.bubble for z, o in zip(zb, one)] == pytest.approx([1 / 3] * p)
    assert max(z.activations for z in zb) == max(o.activations for o in one) == p


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m_over", [0, 1, 5])
def test_qi_zb_h2_has_no_gaps_for_2p_minus_1_activations(p, m_over):
    """Zero bubble in the paper's sense: no rank idles between its first and last action
    (the parallelogram; the paper's post-validated optimizer step lets the next step's
    fill overlap this one's drain). It takes 2p-1 micro-batches in flight on every
    stage, against 1F1B's p on the first, and m >= 2p-1 micro-batches."""
    m = 2 * p - 1 + m_over
    h2 = facts(zb_h2(p, m), 1, 1, 1)
    assert [r.gaps for r in h2] == [0] * p
    assert [r.activations for r in h2] == [2 * p - 1] * p
    h1 = facts(zb_h1(p, m), 1, 1, 1)
    assert min(r.gaps for r in h1[:-1]) > 0          # ZB-H1 idles inside the step


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m_over", [0, 1, 5])
def test_qi_zb_v_has_no_gaps_at_the_memory_of_1f1b(p, m_over):
    """Two chunks of half a stage, F = I = W per chunk: ZB-H2's zero gaps with 1F1B's
    peak activation memory, p stage-micro-batches."""
    m = 2 * p - 1 + m_over
    v = facts(zb_v(p, m), 0.5, 0.5, 0.5)
    one = facts(one_f_one_b(p, m), 1, 1, 1)
    assert [r.gaps for r in v] == [0] * p
    assert max(r.activations for r in v) == max(r.activations for r in one) == p
    assert [r.bubble for r in v] == pytest.approx([(p - 1) * 0.5] * p)   # the fill only
