"""What ``planner.plan`` returns: the chosen layout, its evaluation and the proof around it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.estimate import Estimate
from planner.layout import Layout
from planner.specs import ClusterSpec, ModelSpec, SearchSpace, TrainingJob


class Alternative(BaseModel):
    """A next-best layout with different parallel degrees or schedule."""

    model_config = ConfigDict(frozen=True)

    layout: Layout
    step_time_s: float = Field(description="Its evaluated step time (seconds).")
    peak_bytes: int = Field(description="Its largest per-rank memory peak (bytes).")
    simulated_step_s: float | None = Field(
        default=None,
        description="Its simulated step (seconds), where the plan's choice needed it "
        "(SimulatedStep.chosen).",
    )


class Binding(BaseModel):
    """One constraint that keeps a job from fitting, and what would relax it."""

    model_config = ConfigDict(frozen=True)

    family: str = Field(description="Constraint family, e.g. 'memory', 'host_ram', 'degrees'.")
    where: str = Field(description="Which rank / setting it binds on.")
    excess: str = Field(description="By how much (with a unit).")


class Explanation(BaseModel):
    """Why no layout fits, and the smallest changes found (by re-solving) that would."""

    model_config = ConfigDict(frozen=True)

    summary: str = Field(description="One paragraph for a person.")
    binding: list[Binding] = Field(default_factory=list)
    fixes: list[str] = Field(
        default_factory=list, description="Changes that were re-solved and found to fit."
    )


class FrameworkBest(BaseModel):
    """The best plan one framework runs, when a search covers several
    (``SearchSpace.framework``)."""

    model_config = ConfigDict(frozen=True)

    framework: str = Field(description="The framework (planner.frameworks.LAUNCHERS).")
    status: Literal["optimal", "feasible", "infeasible", "unsettled"] = Field(
        description="unsettled: no layout found in its share of the time, none proven."
    )
    step_time_s: float | None = Field(
        default=None, description="Its best plan's evaluated step time (seconds)."
    )
    gap: float | None = Field(default=None, description="Its proven gap (fraction).")


class SimulatedStep(BaseModel):
    """The plan's layout run by the simulator (``planner.simulate``), beside its estimate."""

    model_config = ConfigDict(frozen=True)

    step_time_s: float = Field(
        description="Simulated seconds per step (planner.executor: each rank's kernels and "
        "transfers on shared streams, SMs and links; no closed-form overlap rule)."
    )
    difference: float = Field(description="Simulated step over the estimate's, less 1.")
    tolerance: float = Field(
        description="The difference within which the two models are taken to agree "
        "(planner.simulate.SIM_TOLERANCE)."
    )
    chosen: str = Field(
        default="",
        description="Empty where the plan is the search's best by the estimate. Else why not: "
        "that layout's simulation disagreed with its estimate beyond the tolerance, and of "
        "the final candidates the plan is the fastest counted at the slower of its two "
        "figures.",
    )

    @property
    def agrees(self) -> bool:
        return abs(self.difference) <= self.tolerance


class Plan(BaseModel):
    """The planner's answer for one (model, cluster, job, search space)."""

    model_config = ConfigDict(frozen=True)

    status: Literal["optimal", "feasible", "infeasible"]
    layout: Layout | None = Field(default=None, description="None when infeasible.")
    estimate: Estimate | None = Field(
        default=None, description="planner.evaluate(layout): the plan's own figures."
    )
    objective_s: float | None = Field(
        default=None, description="Step time the solver's model gives the layout (seconds)."
    )
    lower_bound_s: float | None = Field(
        default=None, description="Proven lower bound on the step time over the space (s)."
    )
    gap: float | None = Field(
        default=None, description="(objective - lower bound) / objective; 0 when optimal."
    )
    solve_time_s: float = Field(description="Wall time of the search (seconds).")
    configurations: int = Field(
        default=0, description="Degree/schedule combinations considered in the search."
    )
    alternatives: list[Alternative] = Field(default_factory=list)
    simulation: SimulatedStep | None = Field(
        default=None,
        description="The layout's simulated step beside its estimate (None when infeasible).",
    )
    stopped_by_clock: bool = Field(
        default=False,
        description="The wall-clock safety stop cut the search short of its deterministic "
        "budget: the plan may then depend on the machine's speed.",
    )
    explanation: Explanation | None = Field(default=None, description="Set when infeasible.")
    frameworks: list[FrameworkBest] = Field(
        default_factory=list,
        description="With several target frameworks: the best plan of each (the plan is the "
        "fastest of them, run by job.framework).",
    )
    model: ModelSpec | None = Field(default=None, description="What was planned (the input).")
    cluster: ClusterSpec | None = Field(default=None, description="... on which cluster.")
    job: TrainingJob | None = Field(default=None, description="... for which training job.")
    space: SearchSpace | None = Field(default=None, description="... within which choices.")
