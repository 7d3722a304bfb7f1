"""Plan a real training run: predict its step time and memory from the model, the
cluster and the layout, with the schedules and the simulator the lessons teach.

    from pipeline_lib.plan import Model, Cluster, Layout, CLUSTERS, predict, search
    plan = predict(Model(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200),
                   CLUSTERS["A100-80GB"],
                   Layout(tp=8, pp=8, dp=1, micro_batch=1, global_batch=64))
    plan.step_time, plan.memory, plan.mfu, plan.timeline
"""
from pipeline_lib.plan.communication import communication_bytes, executor_bytes
from pipeline_lib.plan.hardware import CLUSTERS, Cluster
from pipeline_lib.plan.memory import Memory
from pipeline_lib.plan.model import Kernels, Layout, Model, Work
from pipeline_lib.plan.predict import Plan, predict
from pipeline_lib.plan.search import Candidate, Rejected, SearchResult, differences, search

__all__ = ["CLUSTERS", "Candidate", "Cluster", "Kernels", "Layout", "Memory", "Model", "Plan",
           "Rejected", "SearchResult", "Work", "communication_bytes", "differences",
           "executor_bytes", "predict", "search"]
