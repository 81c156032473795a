"""Checks of the input tensors as they stream into a RAM merge.

Every path that reads tensors calls these before any arithmetic (the
statistics pass, the merge inside mergekit's graph, the in-memory API), so a
bad input fails with a RAMInputError that names the tensor and the models,
instead of a raw torch error or a merged model full of NaN.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from torch import Tensor

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.naming import module_of

# One tensor of every model (base and task models), by model.
Group = Mapping[Hashable, Tensor]


def from_base(dtype: torch.dtype | None) -> bool:
    """The one rule for buffers: RAM merges floating-point tensors only, so
    an integer or bool tensor (position ids, masks) has no task vector and
    is the base's, as is (even where a task model's differs)."""
    return dtype is not None and not dtype.is_floating_point


def check_layout(
    name: str, tensors: Group, base: Hashable, vocabulary_axis: int | None = None
) -> None:
    """Refuse task tensors whose kind or shape differs from the base's.

    RAM merges task vectors θ_t − θ₀, which only exist when every model holds
    the tensor with the base's shape. A floating-point base is required here;
    callers pass a non-float base buffer through before calling this.
    """
    base_tensor = tensors[base]
    if odd_kind := [m for m, t in tensors.items() if not t.is_floating_point()]:
        found = ", ".join(f"model {m} ({tensors[m].dtype})" for m in odd_kind)
        raise RAMInputError(
            f"Tensor {name} is floating point ({base_tensor.dtype}) in the base "
            f"model {base} but not in {found}: RAM needs the same kind of tensor "
            "in every model."
        )
    odd_shape = [m for m, t in tensors.items() if t.shape != base_tensor.shape]
    if not odd_shape:
        return
    found = ", ".join(f"{tuple(tensors[m].shape)} in model {m}" for m in odd_shape)
    # Axes along which same-rank shapes differ (none when the ranks differ);
    # the token axis by tensor name when mergekit gave none.
    shapes = {tuple(t.shape) for t in tensors.values()}
    ranks = {len(shape) for shape in shapes}
    axes = {a for a in range(min(ranks)) if len({s[a] for s in shapes}) > 1}
    if vocabulary_axis is None and module_of(name) in ("embeddings", "lm_head"):
        vocabulary_axis = 0
    hint = (
        f"Only the vocabulary axis ({vocabulary_axis}) differs: the models have "
        "different vocabularies. For a mergekit-yaml merge set "
        "`tokenizer_source: union` (or `base`, or one model's path) in the "
        "config: mergekit then lines the embedding rows up by token before "
        "merging. In-memory inputs must be aligned by the caller."
        if len(ranks) == 1 and axes == {vocabulary_axis}
        else "RAM merges fine-tunes of one base model: every tensor must have the "
        "base's shape (are these models of the same architecture and size?)."
    )
    raise RAMInputError(
        f"Tensor {name} is {tuple(base_tensor.shape)} in the base model {base} "
        f"but {found}. {hint}"
    )


def uncomputable(dtype: torch.dtype) -> str | None:
    """Why a merge cannot compute with tensors of `dtype` (None: it can).

    torch implements no arithmetic for its 8-bit (and smaller) float types;
    those are quantized formats whose values mean something only with the
    scales stored beside them, so casting them is no fix either.
    """
    if dtype.is_floating_point and dtype.itemsize == 1:
        return (
            "torch has no arithmetic for: a quantized format, whose values mean "
            "something only with the scales stored beside them"
        )
    return None


def _all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite.

    A sum is about ten times cheaper than isfinite().all() and is non-finite
    whenever an element is; only when the sum itself overflows does the exact
    check run.
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def finite_inputs(
    name: str, base_id: Hashable, base: Tensor, tasks: Group, nonfinite: str
) -> dict[Hashable, Tensor]:
    """The task tensors to merge, after the `nonfinite` rule.

    `refuse` raises on the first NaN or Inf in the base or a task. `ignore`
    replaces a task's element by the base's wherever either is non-finite, so
    that element counts as unchanged for that task (|τ| is 0 or NaN, never
    above ε) in the statistics and the kernel alike, and the output keeps the
    base's value, non-finite or not. Finite tensors are returned as they are.
    """
    if nonfinite == "refuse":
        for model, tensor in {base_id: base, **tasks}.items():
            if _all_finite(tensor):
                continue
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            raise RAMInputError(
                f"Tensor {name} of {'base model' if model == base_id else 'model'} "
                f"{model} has {nan} NaN and {inf} infinite values (of "
                f"{tensor.numel()}, read as {tensor.dtype}); a merge would carry "
                "them into the output. Fix the checkpoint, or set the merge "
                "parameter `nonfinite: ignore` to treat them as unchanged (the "
                "output keeps the base model's value there)."
            )
        return dict(tasks)
    base_finite = _all_finite(base)
    kept = dict(tasks)
    for model, tensor in tasks.items():
        if not (base_finite and _all_finite(tensor)):
            usable = torch.isfinite(tensor) & torch.isfinite(base)
            # where() promotes to the wider dtype, so the base's value is exact.
            kept[model] = torch.where(usable, tensor, base)
    return kept


def finite_output(
    name: str, base: Tensor, written: Tensor, nonfinite: str = "refuse"
) -> None:
    """Refuse a merged tensor that became non-finite where its base is finite.

    The inputs were checked (or, with `nonfinite: ignore`, a task's bad value
    replaced by the base's), so such a value comes from λ·τ overflowing the
    compute or the output dtype; it is a parameter the user must change.
    """
    if _all_finite(written):
        return
    if (count := int((~torch.isfinite(written) & torch.isfinite(base)).sum())) == 0:
        return
    hint = "" if nonfinite == "refuse" else " (their finite values)"
    raise RAMInputError(
        f"Merged tensor {name} has {count} infinite or NaN values (of "
        f"{written.numel()}, written as {written.dtype}, largest "
        f"{torch.finfo(written.dtype).max:g}) where the inputs{hint} are finite: "
        "λ·τ overflowed. Lower the merge parameters r, alpha or unique_scale, or "
        "write a wider dtype (out_dtype: float32)."
    )
