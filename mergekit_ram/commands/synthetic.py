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
from typing import NamedTuple

import torch


class AgentSpec(NamedTuple):
    name: str
    density: float  # fraction of the model's elements this agent changes


# Densities near the paper's agents (3.2 % / 46.2 % / 54.3 % changed).
PAPER_LIKE = (
    AgentSpec("coder", 0.032),
    AgentSpec("tool_caller", 0.462),
    AgentSpec("memory", 0.543),
)


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


def build_models(
    root: str,
    agents: Sequence[AgentSpec] = PAPER_LIKE,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    config_overrides: dict | None = None,
) -> dict[str, str]:
    """Write base and agents under `root`; returns name → path (base under
    'base'). Each agent changes about its density of each tensor's elements,
    by a factor 1 ± 0.5 from tensor to tensor so that per-tensor overlap
    ratios differ from the whole-model ones."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    values = dict(vocab_size=128, hidden_size=64, intermediate_size=128)
    values |= dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    values |= dict(max_position_embeddings=128, tie_word_embeddings=False)
    config = LlamaConfig(**values | (config_overrides or {}))
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    # Rounded once to the checkpoint dtype: deltas are measured from what is saved.
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(seed + 1)
    states = {"base": base}
    for spec in agents:
        states[spec.name] = agent = {}
        for index, (name, tensor) in enumerate(sorted(base.items())):
            density = min(1.0, spec.density * (1.5 if index % 2 else 0.5))
            keep = torch.rand(tensor.shape, generator=generator) < density
            delta = torch.randn(tensor.shape, generator=generator) * 0.02
            agent[name] = (tensor.float() + delta * keep).to(dtype)
    paths = {}
    for name, state in states.items():
        paths[name] = path = os.path.join(root, name)
        model.load_state_dict(state)
        config.dtype = dtype
        model.save_pretrained(path, safe_serialization=True)
        save_tokenizer(path, config.vocab_size)
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
