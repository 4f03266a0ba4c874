"""The solver: ``plan`` searches degrees, schedules, stage boundaries and recompute with
CP-SAT and returns a ``Plan`` with its proof (see ``planner.solve.search``)."""

from planner.solve.result import Alternative, Binding, Explanation, FrameworkBest, Plan
from planner.solve.search import plan

__all__ = ["Alternative", "Binding", "Explanation", "FrameworkBest", "Plan", "plan"]
