"""planner: choose how a large model is laid out across a GPU cluster for training.

Public API (stable names)::

    model = planner.load_model("deepseek-v3")
    cluster = planner.load_cluster("h800", gpus=2048)
    job = planner.TrainingJob(seq_len=4096, global_batch=15360)
    layout = planner.Layout.uniform(model, pp=16, dp=128, ep=64)
    est = planner.evaluate(model, cluster, job, layout)   # est.memory, est.step_time_s, ...
    sim = planner.simulate(model, cluster, job, layout)   # sim.step_time_s, sim.peak_bytes
    sim.to_chrome_trace("trace.json")                     # open in https://ui.perfetto.dev
    plan = planner.plan(model, cluster, job)              # the fastest layout, with its proof
    planner.export.megatron(plan)                         # or .torchtitan(plan), .deepspeed(plan)
    planner.fit_profile(cluster, runs)                    # constants fitted to measured runs
    runs = planner.runs_from_logs(["run.log"])            # Megatron-LM, torchtitan, DeepSpeed logs
    r = planner.load_recipe("llama3-405b-8192")          # a published layout: r.model, r.layout
    planner.sweep(["llama3-70b"], [64, 128], jobs=[job])  # many cases, resumable (SQLite)
"""

from planner import export
from planner.catalog import cluster_names, load_cluster, load_model, model_names
from planner.errors import PlannerError
from planner.estimate import Estimate, evaluate
from planner.fit import Run, fit_profile, fit_runs
from planner.layout import BlockPlacement, Layout, Stage
from planner.logs import LoggedRun, runs_from_logs
from planner.recipes import Recipe, load_recipe, recipe_names
from planner.simulate import Simulation, simulate
from planner.solve import Plan, plan
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob
from planner.sweep import sweep

__all__ = [
    "BlockPlacement",
    "ClusterSpec",
    "Estimate",
    "Layout",
    "LoggedRun",
    "ModelSpec",
    "Plan",
    "PlannerError",
    "Recipe",
    "Run",
    "SearchSpace",
    "Simulation",
    "Stage",
    "TrainingJob",
    "cluster_names",
    "evaluate",
    "export",
    "fit_profile",
    "fit_runs",
    "load_cluster",
    "load_model",
    "load_recipe",
    "model_names",
    "plan",
    "recipe_names",
    "runs_from_logs",
    "simulate",
    "sweep",
]
