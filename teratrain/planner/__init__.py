"""Planner: per-GPU memory and step time of any layout, before the distributed code runs it.

Arithmetic on config objects: `memory.plan_memory`, `time.plan_time`, `search.search`; `teratrain
plan` (cli.py) shows the result. docs/planner.md explains every term. The planner reads the rules
the engines follow (the strategies' plans and checks: parallel/tp_plan.py, ep_plan.py, support.py,
buckets.py, flat.py, pipeline/split.py) and never imports the engines themselves
(tests/unit/test_import_graph.py).
"""

from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.memory import MemoryBreakdown, plan_memory
from teratrain.planner.search import Candidate, evaluate, search
from teratrain.planner.states import PlanError, model_states
from teratrain.planner.time import TimeBreakdown, plan_time

__all__ = ["Candidate", "Layout", "MemoryBreakdown", "ModelShape", "PlanError", "TimeBreakdown", "Training",
           "evaluate", "model_states", "plan_memory", "plan_time", "search"]
