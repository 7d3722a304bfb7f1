"""The planner (`pipeline_lib.plan`): how fast its search is, and how well it predicts.

    python bench/bench_plan.py                 # search time for every Narayanan et al. row
    python bench/bench_plan.py --accuracy      # every published row: planner vs constant
    python bench/bench_plan.py --refit         # each third fitted: how far factors move
    python bench/bench_plan.py --unseen        # published runs that no test names
    python bench/bench_plan.py --local --quick # this machine measured; bench_distributed's
    python bench/bench_plan.py --local         #   runs and notebook 03's step, predicted and
                                               #   run (minutes; quiet machine!)

Search: `search` on each row of Narayanan et al. 2021, Table 1 (the 1T row, 3,072 GPUs,
is the issue's target: under 10 s on 2 cores) and on Llama 3 405B at 8,192 H100s,
``--repeats`` times for the 1T row, the median kept (wall and CPU seconds: under load
only the CPU's mean anything); with each, the published layout's predicted step and the
best found, and how they differ.

Accuracy: every row of `plan.published.RUNS`, the planner's step against the published
one, beside the constant-throughput baseline's (each GPU type's mean model TFLOP/s over
the calibration rows); the summary on the rows not used to calibrate. Refit: each GPU
type's two factors fitted on each of its three thirds in turn, with the held-out error
of each fit: how much the factors move, and what that does to the claim.

Local: ``--rounds`` rounds, each measuring this machine (`measure_local_cluster`, with
the model and its block: the FLOP/s of its own multiplies and the bytes/s of its block's
other kernels, per token added; what an operation of its block costs at one token,
forward and backward apart; what the stage runner adds per action; gloo sends, or a
thread hand-off with the other stage's thread computing; medians, like the steps) and
then timing the runs, so that measurements and steps see the machine alike. Each
prediction is priced with the rounds' median numbers and the kernels the real modules
dispatch, counted once (`plan.kernels.count_kernels`). The runs: bench/bench_distributed.py's
(2 ranks × 1 thread, GPipe and 1F1B, m = 4 and 8, its "pipeline_lib" rows only; the
headline model, or ``--quick``'s) and notebook 03's "pipelined" step (threaded `Pipe`, 2
stage threads, "cpu" preset with dropout, WikiText-2, batch 20 × 35, m = 4, GPipe), both
on the planner's split (blocks halved, the embedding first, the head last), forward and
backward without an optimizer step, so each is compared with `Plan.pipeline_time`.
Prints one JSON object per row, then a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench_distributed, beside this


from pipeline_lib.plan import CLUSTERS, Cluster, Layout, Model, predict, search  # noqa: E402
from pipeline_lib.plan.model import layers_per_chunk  # noqa: E402
from pipeline_lib.plan.search import differences  # noqa: E402


def bench_search(repeats: int) -> None:
    from pipeline_lib.plan.published import BY_NAME, RUNS   # with their citations
    rows = []
    chosen = [run for run in RUNS if run.framework == "Megatron-LM (2021)"] \
        + [BY_NAME["Llama 3 405B, 8192 GPUs"]]
    for run in chosen:
        cluster = CLUSTERS[run.cluster_name]
        flash = run.layout.flash_attention
        times, cpu, result = [], [], None
        for _ in range(repeats if run.name == "1008B" else 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = search(run.model, cluster, run.layout.gpus, run.layout.global_batch,
                            flash_attention=flash)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        published = predict(run.model, cluster, run.layout)
        best = result.best
        row = dict(run=run.name, gpus=run.layout.gpus, search_s=statistics.median(times),
                   search_cpu_s=statistics.median(cpu), search_times_s=times,
                   layouts=len(result.ranked), rejected=len(result.rejected),
                   measured_step_s=run.step_time, published_predicted_s=published.step_time,
                   best_predicted_s=best.step_time, best_memory_gib=best.memory / 2 ** 30,
                   differs=differences(best.layout, run.layout))
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'run':>24} {'GPUs':>5} {'wall s':>7} {'CPU s':>6} {'fit':>6} {'rejected':>9} "
          f"{'measured s':>11} {'predicted s':>12} {'best s':>7}  best differs in")
    for r in rows:
        print(f"{r['run']:>24} {r['gpus']:>5} {r['search_s']:>7.2f} {r['search_cpu_s']:>6.2f} "
              f"{r['layouts']:>6} {r['rejected']:>9} {r['measured_step_s']:>11.2f} "
              f"{r['published_predicted_s']:>12.2f} {r['best_predicted_s']:>7.2f}  "
              f"{r['differs']}")


def accuracy_rows(clusters: dict[str, Cluster], calibration: list[str]) -> list[dict]:
    """Every published row priced with ``clusters``, beside the constant baseline of the
    same ``calibration`` rows."""
    from pipeline_lib.plan.published import RUNS, baseline_step_time, constant_baseline
    rates = constant_baseline(calibration)
    rows = []
    for run in RUNS:
        plan = predict(run.model, clusters[run.cluster_name], run.layout)
        rows.append(dict(run=run.name, gpu=run.cluster_name, framework=run.framework,
                         layout=f"{run.layout.tp}x{run.layout.cp}x{run.layout.pp}x"
                                f"{run.layout.dp}", m=run.layout.microbatches,
                         published_s=run.step_time, predicted_s=plan.step_time,
                         error=plan.step_time / run.step_time - 1,
                         baseline_error=baseline_step_time(run, rates) / run.step_time - 1,
                         calibration=run.name in calibration,
                         memory_gib=plan.memory / 2 ** 30, fits=plan.fits))
    return rows


def summary(rows: list[dict]) -> dict:
    held = [r for r in rows if not r["calibration"]]
    mine = [abs(r["error"]) for r in held]
    base = [abs(r["baseline_error"]) for r in held]
    return dict(held_out=len(held), median=statistics.median(mine), worst=max(mine),
                baseline_median=statistics.median(base), baseline_worst=max(base))


def bench_accuracy() -> None:
    from pipeline_lib.plan.published import CALIBRATION
    calibration = [n for names in CALIBRATION.values() for n in names]
    rows = accuracy_rows(CLUSTERS, calibration)
    for r in rows:
        print(json.dumps(r))
    print(f"\n{'run':>34} {'t×c×p×d':>10} {'m':>5} {'published s':>12} {'predicted s':>12} "
          f"{'error':>7} {'constant':>9}  used for")
    for r in rows:
        print(f"{r['run']:>34} {r['layout']:>10} {r['m']:>5} {r['published_s']:>12.3f} "
              f"{r['predicted_s']:>12.3f} {r['error']:>+7.1%} {r['baseline_error']:>+9.1%}  "
              f"{'calibration' if r['calibration'] else 'held out'}")
    print(json.dumps(summary(rows)))


def bench_refit() -> None:
    from pipeline_lib.plan.calibrate import calibrate
    from pipeline_lib.plan.published import BY_NAME, GPU_TYPES, thirds
    results = []
    for k in range(3):
        fitted, calibration = {}, []
        for gpu in GPU_TYPES:
            names = thirds(gpu)[k]
            calibration += names
            runs = [(BY_NAME[n].model, BY_NAME[n].layout, BY_NAME[n].step_time)
                    for n in names]
            fitted[gpu] = calibrate(CLUSTERS[gpu], runs)
        result = dict(third=k, factors={g: (c.matmul_efficiency, c.bandwidth_efficiency)
                                        for g, c in fitted.items()},
                      calibration=calibration,
                      **summary(accuracy_rows(fitted, calibration)))
        results.append(result)
        print(json.dumps(result), flush=True)
    print(f"\n{'third':>5} " + " ".join(f"{g + ' matmul, bandwidth':>30}" for g in GPU_TYPES)
          + f" {'median':>7} {'worst':>6} {'constant median':>16}")
    for r in results:
        print(f"{r['third']:>5} " + " ".join(f"{f'{m:.2f}, {b:.2f}':>30}"
                                             for m, b in r['factors'].values())
              + f" {r['median']:>7.1%} {r['worst']:>6.1%} {r['baseline_median']:>16.1%}")


def even_split(layers: int) -> list[int]:
    """The planner's split of ``Sequential(embedding, *blocks, head)`` on 2 stages: the
    blocks halved (`layers_per_chunk`), the embedding first, the head last."""
    first, second = layers_per_chunk(layers, 2)
    return [1 + first, second + 1]


def counted(model: Model, torch_model, ids, target, loss_fn) -> Model:
    from pipeline_lib.plan.kernels import count_kernels
    return replace(model, kernels=count_kernels(torch_model, ids, target, loss_fn))


def median_cluster(clusters: list[Cluster]) -> Cluster:
    """Each measured number's median over the rounds: measurements taken between the
    timed runs, so that both see the machine as it was."""
    numeric = ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
               "latency", "kernel_overhead", "backward_overhead", "action_overhead",
               "send_overhead", "receive_overhead")
    return replace(clusters[0], **{k: statistics.median(getattr(c, k) for c in clusters)
                                   for k in numeric})


def bench_distributed_runs(quick: bool, steps: int | None, rounds: int) -> list[dict]:
    """bench/bench_distributed.py's "pipeline_lib" runs (2 ranks × 1 thread, GPipe and
    1F1B, m = 4 and 8) on the planner's split, each round's cluster measured between
    them; the prediction priced with the medians."""
    import torch
    from bench_distributed import HEADLINE, QUICK, SCHEDULES, batch, build, launch_ranks, lm_loss
    from pipeline_lib.plan.local import measure_local_cluster

    config = QUICK if quick else HEADLINE
    base = Model(layers=config.layers, hidden=config.d_model, heads=config.heads,
                 seq_len=config.seq, vocab=config.vocab, ffn_hidden=config.ff)
    torch.set_num_threads(1)
    microbatches = [4, 8]
    inputs, target = batch(config)
    block = build(config)[1]
    models = {m: counted(base, build(config), inputs[:config.batch // m],
                         target[:config.batch // m], lm_loss) for m in microbatches}
    balance = even_split(config.layers)
    args = argparse.Namespace(warmup=1, steps=steps or (2 if quick else 4),
                              microbatches=microbatches, ours_only=True)
    clusters: dict[int, list[Cluster]] = {m: [] for m in microbatches}
    measured: dict[tuple[str, int], list[float]] = {}
    stage_s: dict[tuple[str, int], list[list[float]]] = {}
    for _ in range(rounds):
        for m in microbatches:
            clusters[m].append(measure_local_cluster(1, 2, models[m], config.batch // m,
                                                     block=block))
        for run in launch_ranks(config, balance, args):
            if run["impl"] == "pipeline_lib":
                measured.setdefault((run["schedule"], run["m"]), []).extend(run["steps_s"])
                stage_s.setdefault((run["schedule"], run["m"]), []).append(run["stage_s"])
    rows = []
    for (schedule, m), times in measured.items():
        cluster = median_cluster(clusters[m])
        layout = Layout(pp=2, micro_batch=config.batch // m, global_batch=config.batch,
                        schedule=schedule, flash_attention=True)
        plan = predict(models[m], cluster, layout)
        rows.append(dict(run=f"bench_distributed {SCHEDULES[schedule]}", m=m,
                         measured_s=statistics.median(times), measured_steps_s=times,
                         predicted_s=plan.pipeline_time, balance=balance,
                         stage_s=[statistics.median(s) for s in zip(*stage_s[schedule, m])],
                         predicted_stage_s=[f + b for f, b in zip(plan.costs.forward,
                                                                  plan.costs.backward)],
                         cluster=cluster.__dict__, config=config.__dict__))
    return rows


def notebook03_run(steps: int, rounds: int) -> list[dict]:
    """Notebook 03's measured step: the "cpu" preset (dropout 0.2) on WikiText-2, batch 20
    × bptt 35, m = 4, GPipe, two stage threads of the threaded `Pipe` (one intra-op thread
    each), no checkpointing, on the planner's split; forward and backward of the batch
    (`pipe.step`), as the notebook times "pipelined"."""
    import torch
    from pipeline_lib import Pipe
    from pipeline_lib.lm.data import batchify, get_batch, load_wikitext2
    from pipeline_lib.lm.loops import lm_loss, seed_everything
    from pipeline_lib.lm.model import PRESETS, transformer_lm
    from pipeline_lib.plan.local import measure_local_cluster

    batch, chunks, bptt = 20, 4, 35
    torch.set_num_threads(1)
    data = load_wikitext2()
    vocab = len(data.vocab)
    inputs, targets = get_batch(batchify(data.train, batch), 0, bptt)
    seed_everything(0)
    torch_model = transformer_lm(vocab, "cpu")
    preset = PRESETS["cpu"]
    base = Model(layers=preset["nlayers"], hidden=preset["d_model"], heads=preset["nhead"],
                 seq_len=bptt, vocab=vocab, ffn_hidden=preset["d_hid"], dropout=True)
    micro = batch // chunks
    model = counted(base, torch_model, inputs[:micro], targets[:micro], lm_loss)
    balance = even_split(preset["nlayers"])
    pipe = Pipe(torch_model, chunks, checkpoint="never", balance=balance,
                devices=["cpu", "cpu"])
    times, clusters = [], []
    durations: dict[tuple[int, str], list[float]] = {}
    pipe.step(inputs, targets, lm_loss)                       # warm up
    for _ in range(rounds):
        clusters.append(measure_local_cluster(1, 2, model, micro, transport="threads",
                                              block=torch_model[1]))
        for _ in range(steps):
            start = time.perf_counter()
            pipe.step(inputs, targets, lm_loss)
            times.append(time.perf_counter() - start)
            for e in pipe.timeline.events:
                durations.setdefault((e.action.stage, e.action.kind), []).append(e.duration)
    cluster = median_cluster(clusters)
    # dropout in training: PyTorch's CPU attention writes the scores (no fused kernel)
    plan = predict(model, cluster, Layout(pp=2, micro_batch=micro, global_batch=batch,
                                          schedule="gpipe"))
    return [dict(run="notebook 03 threaded Pipe GPipe", m=chunks,
                 measured_s=statistics.median(times), measured_steps_s=times,
                 predicted_s=plan.pipeline_time, balance=balance,
                 stage_s=[statistics.median(durations[s, "F"])
                          + statistics.median(durations[s, "B"]) for s in range(2)],
                 predicted_stage_s=[f + b for f, b in zip(plan.costs.forward,
                                                          plan.costs.backward)],
                 cluster=cluster.__dict__)]


def bench_local(quick: bool, steps: int | None, rounds: int) -> None:
    rows = bench_distributed_runs(quick, steps, rounds) + notebook03_run(steps or 5, rounds)
    for row in rows:
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
        print(json.dumps(row))
    print(f"\n{'run':<36} {'m':>3} {'measured s':>11} {'predicted s':>12} {'error':>7}")
    for r in rows:
        print(f"{r['run']:<36} {r['m']:>3} {r['measured_s']:>11.4f} "
              f"{r['predicted_s']:>12.4f} {r['error']:>+7.1%}")


# Published runs that no test names (issue 28: the planner will be checked on such runs).
# Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
# Sec. 2.4: 105 layers, h 20480, 128 heads, s 2048, vocabulary 50,272 (GPT-2's, padded),
# t 8, p 35, global batch 1,920, on 280 / 350 / 420 DGX A100 40GB servers: 60.1 / 50.2 /
# 44.4 s per iteration. DeepSpeed's pipeline engine (1F1B, one stage per rank), activation
# checkpointing, ZeRO stage 1; micro-batch 1 assumed.
MT_NLG = Model(layers=105, hidden=20480, heads=128, seq_len=2048, vocab=50272)
MT_NLG_RUNS = ((2240, 60.1), (2800, 50.2), (3360, 44.4))
# Korthikanti et al. 2022, abstract: the 530B GPT on 2,240 A100s reaches 42.1% model FLOPs
# utilisation with full recompute, 54.2% with selective recompute and sequence parallelism.
# The model is Narayanan et al.'s 529.6B row (t 8, p 35, v 3); dp = 2240 / 280 = 8; the
# global batch is not in the abstract (2,240 assumed: MFU hardly depends on it here).
KORTHIKANTI_530B = Model(layers=105, hidden=20480, heads=128, seq_len=2048, vocab=51200)


def bench_unseen() -> None:
    a100_40 = replace(CLUSTERS["A100-80GB"], name="A100-40GB", hbm_bytes=40960 * 2 ** 20,
                      hbm_bandwidth=1555e9)       # A100 40GB datasheet: HBM2 at 1,555 GB/s
    rows = []
    for gpus, published in MT_NLG_RUNS:
        layout = Layout(tp=8, pp=35, dp=gpus // 280, micro_batch=1, global_batch=1920,
                        recompute="full", distributed_optimizer=True)
        plan = predict(MT_NLG, a100_40, layout)
        rows.append(dict(run=f"MT-NLG 530B, {gpus} GPUs", measure="s per step",
                         published=published, predicted=plan.step_time,
                         memory_gib=plan.memory / 2 ** 30))
    for name, recompute, sp, published in (("full recompute", "full", False, 0.421),
                                           ("selective + SP", "selective", True, 0.542)):
        layout = Layout(tp=8, pp=35, dp=8, micro_batch=1, global_batch=2240,
                        virtual_stages=3, schedule="interleaved_1f1b", recompute=recompute,
                        sequence_parallel=sp)
        plan = predict(KORTHIKANTI_530B, CLUSTERS["A100-80GB"], layout)
        rows.append(dict(run=f"Korthikanti 530B, 2240 GPUs, {name}", measure="MFU",
                         published=published, predicted=plan.mfu,
                         memory_gib=plan.memory / 2 ** 30))
        rows[-1]["predicted_hfu"] = plan.hfu
    from pipeline_lib.plan.published import NEMO_175B_2209
    for run in NEMO_175B_2209:
        plan = predict(run.model, CLUSTERS[run.cluster_name], run.layout)
        rows.append(dict(run=run.name + " (NeMo 22.09)", measure="s per step",
                         published=run.step_time, predicted=plan.step_time,
                         memory_gib=plan.memory / 2 ** 30))
    for r in rows:
        r["error"] = r["predicted"] / r["published"] - 1
        print(json.dumps(r))
    print(f"\n{'run':<46} {'measure':>10} {'published':>10} {'predicted':>10} {'error':>7}")
    for r in rows:
        print(f"{r['run']:<46} {r['measure']:>10} {r['published']:>10.3f} "
              f"{r['predicted']:>10.3f} {r['error']:>+7.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", action="store_true",
                        help="measure this machine and predict bench_distributed's runs")
    parser.add_argument("--quick", action="store_true", help="with --local: small model")
    parser.add_argument("--steps", type=int, default=None, help="with --local: timed steps")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --local: rounds of (measure the machine, time the runs)")
    parser.add_argument("--repeats", type=int, default=3, help="searches of the 1T row")
    parser.add_argument("--unseen", action="store_true",
                        help="published runs that no test names: MT-NLG, Korthikanti 530B")
    parser.add_argument("--accuracy", action="store_true",
                        help="every published row, planner against the constant baseline")
    parser.add_argument("--refit", action="store_true",
                        help="fit each third of the rows: how far the factors move")
    args = parser.parse_args()
    if args.accuracy:
        bench_accuracy()
    elif args.refit:
        bench_refit()
    elif args.unseen:
        bench_unseen()
    elif args.local:
        bench_local(args.quick, args.steps, args.rounds)
    else:
        bench_search(args.repeats)


if __name__ == "__main__":
    main()
