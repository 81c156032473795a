"""`ram` and `ramplus` as mergekit merge methods: start reading here.

A method is mergekit's frozen object with a declarative spec and
`merge_group`, whose signature declares each parameter's scope, type and
default (the spec is derived from it, as mergekit derives its own methods'
with `easy_define._parameter_spec`, a name it does not publish). It takes
one tensor group and calls the kernel
(`core.kernel.ram_merge_tensor`, or the authors' `shared: ties` / `base`
modes). mergekit plans each tensor as an `ExecuteMergeMethodTask`; the
planner hook (`statistics`) makes it a `RAMMergeTask` of the merge in
progress, which applies RAM's input rules first and hands whole-model λ in
as `unique_scale`. `RAMMerge._execute` overrides mergekit's to hand the
output dtype to the kernel.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal, get_type_hints

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    PerInputValues,
    PerNonBase,
    TensorGroup,
)
from mergekit.merge_methods.dtype import align_dtype
from mergekit.merge_methods.easy_define import _parameter_spec
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from pydantic import BeforeValidator, Field, PrivateAttr

from mergekit_ram.core.checks import (
    check_layout,
    finite_inputs,
    finite_output,
    from_base,
)
from mergekit_ram.core.counting import OverlapStatistics, TaskCounts
from mergekit_ram.core.kernel import ram_merge_tensor
from mergekit_ram.core.modes import ties_merge_tensor, unique_merge_tensor
from mergekit_ram.core.rule import MergeSettings, ScaleRule
from mergekit_ram.integration.context import MergeRun, current_run, running
from mergekit_ram.integration.host import OURS, incompatible

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
    float, BeforeValidator(_no_bool), Field(allow_inf_nan=False), Field(ge=0)
]
# A fraction in [0, 1] (density).
Fraction = Annotated[NonNegative, Field(le=1)]


@dataclass(frozen=True)
class RAMMerge(GroupMergeMethod):
    """Reinforced Agent Merging; r = 0 is RAM, r > 0 RAM+."""

    spec: MergeMethodSpec

    def _execute(
        self,
        groups: Sequence[TensorGroup],
        parameters: list[dict],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, ...]:
        """mergekit casts a method's result to out_dtype after merge_group; the
        kernel gets it instead, so the float32 result is rounded only once.
        Global RAM+ without λ (mergekit's in-memory merge_tensors and
        merge_state_dicts; a config merge's planner hook passes λ) counts
        every group of the call first: the call's inputs are the whole model."""
        parameters = [{**p, "out_dtype": kwargs.get("out_dtype")} for p in parameters]
        # Global RAM+ with some task model's λ still unknown.
        if any(
            None in p["unique_scale"].values()
            for p in parameters
            if p["statistics"] == "global" and p["r"] > 0
        ):
            parameters = _whole_call_scales(groups, parameters, kwargs["input_dtypes"])
        return super()._execute(groups, parameters, *args, **kwargs)

    def merge_group(
        self,
        group: TensorGroup,
        /,
        *,
        # an element counts as changed when |θ_t − θ₀| > epsilon
        epsilon: NonNegative = 1e-5,
        r: NonNegative = 0.0,  # RAM+ strength; 0 is plain RAM
        alpha: NonNegative = 2.0,  # cap on ρ = S/U (clip rule)
        # clip (paper Eq. 6) or soft (λ = 1 + r·S/C)
        saturation: Literal["clip", "soft"] = "clip",
        # global (whole model, the paper) or tensor (per tensor)
        statistics: Literal["global", "tensor"] = "global",
        # refuse NaN/Inf inputs, or ignore them (keep the base there)
        nonfinite: Literal["refuse", "ignore"] = "refuse",
        # shared elements: mean (RAM), ties (the authors' arm-ties) or base
        # (unique elements only, their arm-unique)
        shared: Literal["mean", "ties", "base"] = "mean",
        # with shared: ties, the fraction of each task's shared elements TIES
        # keeps (largest |τ|)
        density: Fraction = 0.1,
        # an explicit λ per task model: skips its statistics
        unique_scale: PerNonBase[NonNegative | None] = None,
        out_dtype: torch.dtype | None = None,  # what is written; not a parameter
    ) -> torch.Tensor:
        base = group.base.tensor
        if from_base(base.dtype):
            return base.clone()
        written = out_dtype or base.dtype
        ids = [entry.id for entry in group.non_base]
        # None: λ from this tensor's own counts (statistics: tensor; a global
        # merge always has λ here, from _execute or the planner).
        name = group.metadata.name or "tensor"
        explicit = [unique_scale.get(i) for i in ids]
        if statistics == "global" and r > 0 and None in explicit:
            # Never per-tensor λ where global was asked: a hook was not reached.
            raise incompatible(f"global RAM+ reached {name} without whole-model λ")
        scales = [1.0 if value is None and r == 0 else value for value in explicit]
        inputs = {entry.id: entry.tensor for entry in group.non_base}
        run = current_run()
        rule = ScaleRule(r=r, alpha=alpha, saturation=saturation)

        def local_scale(index: int, histogram: torch.Tensor) -> float:
            """λ from this tensor's k-way histogram, noted for the card."""
            counts = TaskCounts(histogram.tolist())
            value = rule.scale(counts.shared, counts.unique)
            if run is not None:
                run.local.add(name, ids[index], base.numel(), counts.histogram, value)
            return value

        def count_survival(index: int, rescaled: int, survived: int) -> None:
            if rescaled:
                dtype = str(written).removeprefix("torch.")
                run.tally.add(ids[index], rescaled, survived, dtype)

        check = partial(finite_inputs, name, group.base.id, base, inputs, nonfinite)
        kernel, extra = {
            "mean": (ram_merge_tensor, {}),
            "ties": (ties_merge_tensor, {"density": density}),
            "base": (unique_merge_tensor, {}),
        }[shared]
        if nonfinite != "refuse":
            inputs = check()  # a non-finite value becomes the base's
        elif shared == "mean":
            # The walk's own sums of τ tell finite inputs apart; only a
            # tensor they doubt is read again, element by element.
            extra = {"on_nonfinite": check}
        else:
            check()
        merged = kernel(
            base,
            [inputs[i] for i in ids],
            epsilon=epsilon,
            scales=scales,
            scale_fn=local_scale,
            out_dtype=written,
            on_rescaled=None if run is None or run.tally is None else count_survival,
            **extra,
        )
        finite_output(name, base, merged, nonfinite)
        return merged


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
            base = group.base.tensor
            if not from_base(base.dtype):
                inputs = {entry.id: entry.tensor for entry in group.non_base}
                rule = params["nonfinite"]
                inputs = finite_inputs(name, group.base.id, base, inputs, rule)
                stats.add(name, base, inputs)
    scales = stats.scales(settings.rule, explicit)

    def known(values: PerInputValues) -> PerInputValues:
        return PerInputValues(
            [(m, scales.get(m, 1.0) if v is None else v) for m, v in values.items()]
        )

    return [{**p, "unique_scale": known(p["unique_scale"])} for p in parameters]


def _spec(name: str, pretty_name: str, r: float) -> MergeMethodSpec:
    """The method's parameters as merge_group declares them (mergekit's
    signature-derived spec: scope, type, default), with RAM+'s default r."""
    hints = get_type_hints(RAMMerge.merge_group, include_extras=True)
    specs = {
        a.name: _parameter_spec(a, hints[a.name], batched=False)
        for a in inspect.signature(RAMMerge.merge_group).parameters.values()
        if a.kind is inspect.Parameter.KEYWORD_ONLY and a.name != "out_dtype"
    }
    specs["r"] = dataclasses.replace(specs["r"], default=r)
    return MergeMethodSpec(
        name=name,
        parameters=tuple(specs.values()),
        contract=InputContract(base=BasePolicy.REQUIRED),
        pretty_name=pretty_name,
        reference_url=REFERENCE_URL,
    )


ram = RAMMerge(_spec("ram", "Reinforced Agent Merging (RAM)", 0.0))
ramplus = RAMMerge(_spec("ramplus", "Reinforced Agent Merging Plus (RAM+)", 0.1))
METHODS = (ram, ramplus)


def is_ours(name: object) -> bool:
    return isinstance(name, str) and name in OURS


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
        if (base := tensors.get(self.base_model)) is not None:
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
    ram_task = RAMMergeTask(**{**dict(task), "out_dtype": out_dtype})
    ram_task._run = run
    return ram_task
