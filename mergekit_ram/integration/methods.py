"""`ram` and `ramplus` as mergekit merge methods: start reading here.

A method is mergekit's small frozen object with a declarative spec: its
parameters (`_spec`: names, types, scopes, defaults, `PARAMETER_HELP`) and
`merge_group`, which takes one tensor group and calls the kernel
(`core.kernel.ram_merge_tensor`, or the authors' `shared: ties` / `base`
modes). mergekit plans each tensor as an `ExecuteMergeMethodTask`; the
planner hook (`statistics`) makes it a `RAMMergeTask` of the merge in
progress, which applies RAM's input rules first and hands whole-model λ in
as `unique_scale`. Overridden mergekit internals: `_execute` (to pass the
output dtype to the kernel; see install.PATCHES).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    ParameterScope,
    ParameterSpec,
    PerInputValues,
    TensorGroup,
)
from mergekit.merge_methods.dtype import align_dtype
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from pydantic import BeforeValidator, Field, PrivateAttr

from mergekit_ram.core.checks import (
    check_layout,
    finite_inputs,
    finite_output,
    from_base,
)
from mergekit_ram.core.counting import OverlapStatistics, TaskCounts
from mergekit_ram.core.kernel import RescaleFn, ram_merge_tensor
from mergekit_ram.core.modes import ties_merge_tensor, unique_merge_tensor
from mergekit_ram.core.rule import MergeSettings, ScaleRule, SurvivalTally
from mergekit_ram.integration.context import (
    MergeRun,
    current_run,
    running,
)

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"


def _no_bool(value: Any) -> Any:
    """YAML's true / false are not numbers (pydantic would read them as 1 / 0)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


# The one definition of a valid numeric RAM parameter; configuration checks
# (integration.validation) report its pydantic errors as they are.
# Finiteness is checked before the sign, so NaN is reported as NaN.
NonNegative = Annotated[
    float,
    BeforeValidator(_no_bool),
    Field(allow_inf_nan=False),
    Field(ge=0),
]
# A fraction in [0, 1] (density).
Fraction = Annotated[NonNegative, Field(le=1)]

PARAMETER_HELP = {
    "epsilon": "an element counts as changed when |θ_t − θ₀| > epsilon",
    "r": "RAM+ strength; 0 is plain RAM",
    "alpha": "cap on the shared/unique ratio (clip rule)",
    "saturation": "clip (paper Eq. 6) or soft (λ = 1 + r·S/C)",
    "statistics": "global (whole model, the paper) or tensor (per tensor)",
    "unique_scale": "explicit λ for this task model; skips its statistics",
    "nonfinite": "refuse NaN/Inf inputs, or ignore them (keep the base there)",
    "shared": "shared elements: mean (RAM), ties (the authors' arm-ties) or "
    "base (unique elements only, their arm-unique)",
    "density": "with shared: ties, the fraction of each task's shared "
    "elements TIES keeps (largest |τ|)",
}


def _survival_counter(
    tally: SurvivalTally | None, ids: Sequence[Hashable], written: torch.dtype
) -> RescaleFn | None:
    """The kernel's on_rescaled hook adding to `tally` (None: nothing to count)."""
    if tally is None:
        return None
    name = str(written).removeprefix("torch.")

    def count(index: int, rescaled: int, survived: int) -> None:
        if rescaled:
            tally.add(ids[index], rescaled, survived, name)

    return count


@dataclass(frozen=True)
class RAMMerge(GroupMergeMethod):
    """Reinforced Agent Merging; r = 0 is RAM, r > 0 RAM+."""

    spec: MergeMethodSpec

    def _execute(
        self,
        groups: Sequence[TensorGroup],
        parameters: list[dict[str, Any]],
        options: Any,
        *,
        input_dtypes: Sequence[torch.dtype | None],
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """mergekit casts a method's result to out_dtype after merge_group; the
        kernel gets it instead, so the float32 result is rounded only once.
        Global RAM+ without λ (mergekit's in-memory merge_tensors and
        merge_state_dicts; a config merge's planner hook passes λ) counts
        every group of the call first: the call's inputs are the whole model."""
        parameters = [{**p, "out_dtype": out_dtype} for p in parameters]
        if any(_needs_statistics(p) for p in parameters):
            parameters = _whole_call_scales(groups, parameters, input_dtypes)
        return super()._execute(
            groups,
            parameters,
            options,
            input_dtypes=input_dtypes,
            out_dtype=out_dtype,
        )

    def merge_group(
        self,
        group: TensorGroup,
        /,
        *,
        epsilon: float,
        r: float,
        alpha: float,
        saturation: str,
        statistics: str,
        nonfinite: str,
        shared: str,
        density: float,
        unique_scale: PerInputValues[float | None],
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if group.base is None:
            raise ValueError(f"{self.spec.name} needs a base model")
        base = group.base.tensor
        if from_base(base.dtype):
            return base.clone()
        written = out_dtype or base.dtype
        tasks = group.non_base
        rule = ScaleRule(r=r, alpha=alpha, saturation=saturation)
        scales = []
        for entry in tasks:
            # None: λ from this tensor's own counts (statistics: tensor; a
            # global merge always has λ here, from _execute or the planner).
            explicit = unique_scale.get(entry.id)
            scales.append(1.0 if explicit is None and r == 0 else explicit)
        name = group.metadata.name or "tensor"
        inputs = {entry.id: entry.tensor for entry in tasks}
        kernel, extra = {
            "mean": (ram_merge_tensor, {}),
            "ties": (ties_merge_tensor, {"density": density}),
            "base": (unique_merge_tensor, {}),
        }[shared]

        def check() -> dict:
            return finite_inputs(name, group.base.id, base, inputs, nonfinite)

        if nonfinite != "refuse":
            inputs = check()  # a non-finite value becomes the base's
        elif shared == "mean":
            # The walk's own sums of τ tell finite inputs apart; only a
            # tensor they doubt is read again, element by element.
            extra = {"on_nonfinite": check}
        else:
            check()
        ids = [entry.id for entry in tasks]
        merged = kernel(
            base,
            [inputs[i] for i in ids],
            epsilon=epsilon,
            scales=scales,
            scale_fn=_local_scales(rule, name, ids, base),
            out_dtype=written,
            on_rescaled=_survival_counter(_tally(), ids, written),
            **extra,
        )
        finite_output(name, base, merged, nonfinite)
        return merged


def _needs_statistics(parameters: dict[str, Any]) -> bool:
    """Global RAM+ with some task model's λ still unknown."""
    unknown = None in parameters["unique_scale"].values()
    return parameters["statistics"] == "global" and parameters["r"] > 0 and unknown


def _whole_call_scales(
    groups: Sequence[TensorGroup],
    parameters: list[dict[str, Any]],
    input_dtypes: Sequence[torch.dtype | None],
) -> list[dict[str, Any]]:
    """The bound parameters with each task model's λ from the statistics of
    every group, as the merge sees them (its dtype, the `nonfinite` rule)."""
    names = [g.metadata.name or f"tensor group {i}" for i, g in enumerate(groups)]
    settings = MergeSettings.from_parameters(zip(names, parameters))
    stats = OverlapStatistics(epsilon=settings.epsilon)
    explicit: dict[Hashable, float | None] = {}
    with torch.no_grad():
        for name, group, params, dtype in zip(names, groups, parameters, input_dtypes):
            for model, value in params["unique_scale"].items():
                explicit.setdefault(model, value)
            group = align_dtype(group, dtype)
            if group.base is None or from_base(group.base.tensor.dtype):
                continue
            base = group.base.tensor
            inputs = {entry.id: entry.tensor for entry in group.non_base}
            nonfinite = params["nonfinite"]
            stats.add(
                name, base, finite_inputs(name, group.base.id, base, inputs, nonfinite)
            )
    scales = stats.scales(settings.rule, explicit)
    return [
        {
            **params,
            "unique_scale": PerInputValues(
                [
                    (model, scales.get(model, 1.0) if value is None else value)
                    for model, value in params["unique_scale"].items()
                ]
            ),
        }
        for params in parameters
    ]


def _tally() -> SurvivalTally | None:
    """The survival tally of the merge in progress (None: nothing to count)."""
    run = current_run()
    return None if run is None else run.tally


def _local_scales(
    rule: ScaleRule, name: str, ids: Sequence[Hashable], base: torch.Tensor
) -> Callable[[int, torch.Tensor], float]:
    """λ from one tensor's k-way histogram (statistics: tensor), noted in the
    merge in progress for its card."""
    run = current_run()

    def scale(index: int, histogram: torch.Tensor) -> float:
        counts = TaskCounts(histogram.tolist())
        value = rule.scale(counts.shared, counts.unique)
        if run is not None:
            run.local.add(name, ids[index], base.numel(), counts.histogram, value)
        return value

    return scale


def _spec(name: str, pretty_name: str, r: float) -> MergeMethodSpec:
    def shared(param: str, value_type: Any, default: Any) -> ParameterSpec:
        return ParameterSpec(
            param,
            value_type,
            ParameterScope.SHARED,
            default,
            description=PARAMETER_HELP[param],
        )

    return MergeMethodSpec(
        name=name,
        parameters=(
            shared("epsilon", NonNegative, 1e-5),
            shared("r", NonNegative, r),
            shared("alpha", NonNegative, 2.0),
            shared("saturation", Literal["clip", "soft"], "clip"),
            shared("statistics", Literal["global", "tensor"], "global"),
            shared("nonfinite", Literal["refuse", "ignore"], "refuse"),
            shared("shared", Literal["mean", "ties", "base"], "mean"),
            shared("density", Fraction, 0.1),
            ParameterSpec(
                "unique_scale",
                NonNegative | None,
                ParameterScope.NON_BASE,
                None,
                description=PARAMETER_HELP["unique_scale"],
            ),
        ),
        contract=InputContract(base=BasePolicy.REQUIRED),
        pretty_name=pretty_name,
        reference_url=REFERENCE_URL,
    )


ram = RAMMerge(_spec("ram", "Reinforced Agent Merging (RAM)", 0.0))
ramplus = RAMMerge(_spec("ramplus", "Reinforced Agent Merging Plus (RAM+)", 0.1))
METHODS = (ram, ramplus)


def is_ours(name: object) -> bool:
    return isinstance(name, str) and name in {m.spec.name for m in METHODS}


# --- the planned merge task --------------------------------------------------


class RAMMergeTask(ExecuteMergeMethodTask):
    """mergekit's merge task, with RAM's input rules before mergekit's checks.

    A non-float base tensor (an integer or bool buffer) is passed through as
    the base has it, even where a task model's differs (mergekit would
    refuse); mismatched shapes fail with a RAMInputError naming the models
    and, for a vocabulary axis, pointing to tokenizer_source. Its
    out_dtype is the dtype the tensor is written in. It carries the merge it
    belongs to (a private attribute: not part of the task's identity) and
    runs inside it, also on a worker thread, so the method finds the run's
    survival tally.
    """

    _run: MergeRun | None = PrivateAttr(default=None)

    def execute(self, tensors: dict, **kwargs: Any) -> Any:
        base = tensors.get(self.base_model)
        if base is not None:
            if from_base(base.dtype):
                return base
            weight = self.output_weight
            check_layout(weight.name, tensors, self.base_model, weight.vocabulary_axis)
        with running(self._run):
            return super().execute(tensors, **kwargs)


def as_ram_task(
    task: ExecuteMergeMethodTask, out_dtype: str | None, run: MergeRun | None
) -> RAMMergeTask:
    """The same planned merge as a RAMMergeTask of `run`, writing `out_dtype`."""
    fields = type(task).model_fields
    values = {name: getattr(task, name) for name in fields}
    ram_task = RAMMergeTask(**{**values, "out_dtype": out_dtype})
    ram_task._run = run
    return ram_task
