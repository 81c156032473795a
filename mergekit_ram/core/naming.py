"""The part of a model a tensor belongs to, from its name alone (core.checks
asks it which tensors have a vocabulary axis; the report groups by it)."""

from __future__ import annotations

import re

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
