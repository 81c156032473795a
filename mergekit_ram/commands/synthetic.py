"""Tiny Llama checkpoints whose task vectors look like RL agents' (for the demo).

RL fine-tuning leaves sparse task vectors with agent-specific supports. Each
agent here is the base plus a delta on a random subset of elements: the
subsets overlap by chance, so unique, shared and unchanged elements all occur,
and per-tensor densities vary so tensor-local and whole-model statistics
differ.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AgentSpec:
    name: str
    density: float  # fraction of the model's elements this agent changes


# Densities near the paper's agents (3.2 % / 46.2 % / 54.3 % changed).
PAPER_LIKE = (
    AgentSpec("coder", 0.032),
    AgentSpec("tool_caller", 0.462),
    AgentSpec("memory", 0.543),
)


def tiny_llama_config(vocab_size: int = 128, tie: bool = False, **overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def save_tokenizer(path: str, vocab_size: int, prefix: str = "w") -> None:
    """A word-level tokenizer of `vocab_size` tokens: <unk>, <s>, </s>, prefix0…"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"{prefix}{i}" for i in range(vocab_size - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def save_model(state: dict[str, torch.Tensor], config, path: str, dtype) -> str:
    """Save a state dict as a transformers checkpoint (safetensors)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=False)
    model.to(dtype)
    config.dtype = dtype
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, config.vocab_size)
    return path


def sparse_agent(
    base: dict[str, torch.Tensor],
    density: float,
    generator: torch.Generator,
    *,
    magnitude: float = 0.02,
    skew: float = 0.5,
) -> dict[str, torch.Tensor]:
    """base + a delta on about `density` of the elements.

    Density varies from tensor to tensor (by a factor of 1 ± skew) so that
    per-tensor overlap ratios differ from the whole-model ones.
    """
    agent = {}
    for index, (name, tensor) in enumerate(sorted(base.items())):
        factor = 1.0 + skew * (1 if index % 2 else -1)
        keep = torch.rand(tensor.shape, generator=generator) < min(
            1.0, density * factor
        )
        delta = torch.randn(tensor.shape, generator=generator) * magnitude
        agent[name] = tensor + delta * keep
    return agent


def build_models(
    root: str,
    agents: Sequence[AgentSpec] = PAPER_LIKE,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    tie: bool = False,
    config_overrides: dict | None = None,
) -> dict[str, str]:
    """Write base and agents under `root`; returns name → path (base under 'base')."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(tie=tie, **(config_overrides or {}))
    base_model = AutoModelForCausalLM.from_config(config).to(dtype)
    # Round once to the checkpoint dtype so deltas are measured from what is saved.
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    if tie:
        base.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(seed + 1)
    paths = {"base": save_model(base, config, os.path.join(root, "base"), dtype)}
    for spec in agents:
        state = sparse_agent(
            {k: v.float() for k, v in base.items()}, spec.density, generator
        )
        state = {k: v.to(dtype) for k, v in state.items()}
        paths[spec.name] = save_model(
            state, config, os.path.join(root, spec.name), dtype
        )
    return paths


def merge_yaml(paths: dict[str, str], method: str, **parameters) -> str:
    """A mergekit YAML config merging every non-base path onto the base."""
    import yaml

    config: dict = {
        "merge_method": method,
        "base_model": paths["base"],
        "models": [{"model": p} for n, p in paths.items() if n != "base"],
    }
    if parameters:
        config["parameters"] = parameters
    return yaml.safe_dump(config, sort_keys=False)
