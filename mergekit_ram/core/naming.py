"""Names: the part of a model a tensor belongs to (from its name alone), and
short display names for models (reports and the model card)."""

from __future__ import annotations

import re
from collections.abc import Sequence

MODULES = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")


def module_of(name: str) -> str:
    """embeddings, attention, mlp, norms, lm_head or other, from a tensor name."""
    lower = name.lower()
    if "lm_head" in lower or "embed_out" in lower:
        return "lm_head"
    if "embed" in lower or re.search(r"(^|\.)(wte|wpe)(\.|$)", lower):
        return "embeddings"
    if "norm" in lower or re.search(r"(^|\.)ln_?\w*(\.|$)", lower):
        return "norms"
    if re.search(r"attn|attention|(^|\.)(q|k|v|o|qkv)_proj(\.|$)", lower):
        return "attention"
    if re.search(r"mlp|feed_forward|ffn|(up|down|gate)_proj|(^|\.)fc\d", lower):
        return "mlp"
    return "other"


def layer_of(name: str) -> int | None:
    """The layer index in a tensor name (first all-digit component), or None."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else None


def labels_for(models: Sequence[str]) -> dict[str, str]:
    """Short names: last path component, or the full name where those collide."""
    short = {m: m.split("+")[0].rstrip("/").split("/")[-1] or m for m in models}
    if len(set(short.values())) < len(short):
        return {m: m for m in models}
    return short
