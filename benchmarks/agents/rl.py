"""On-policy RL from the base, GRPO-style: group-normalised advantages, no SFT.

Each step samples `group` completions for each of `prompts` training prompts,
scores them with the task's exact reward, and takes one policy-gradient step
on the completion tokens with advantage (r - mean_group) / (std_group + 1e-4).
With one update per batch the clipped GRPO ratio is 1, so the loss is the
token-mean of -A·log π; no KL term (β = 0) and no weight decay, so weights the
policy gradient does not move stay bit-identical in the bf16 checkpoint.
Master weights are float32 by default, the agent saved in bf16 like real RL
releases; `master: bfloat16` rounds the weights to bf16 after every optimizer
step (forward and Adam state stay float32), so each update smaller than half a
bf16 ulp of its weight rounds away. `mask: p` lets the agent update only a
seeded random share p of each tensor's elements (sparse fine-tuning: supports
independent between agents by construction), and `save: float32` writes the
float32 weights instead of rounding them to bf16, so every masked element the
gradient moved stays changed (a release in full precision).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from generation import MAX_NEW_TOKENS, forward_completions, prefill, sample
from tasks import TASKS, examples

MASTERS = ("float32", "bfloat16")
SAVES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class RLConfig:
    """Hyperparameters of one agent's training run (config.yaml: `rl:`)."""

    steps: int
    prompts: int
    group: int
    temperature: float
    lr: float
    grad_clip: float = 1.0
    seed: int = 0
    master: str = "float32"  # dtype of the weights the optimizer updates
    mask: float = 1.0  # share of each tensor's elements the optimizer may move
    save: str = "bfloat16"  # dtype the agent is written in


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for generated tokens up to and including the first EOS, 0 after it."""
    is_eos = completions == eos_id
    after_eos = (torch.cumsum(is_eos.int(), dim=1) - is_eos.int()) > 0
    return (~after_eos).float()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-4); all-equal groups get 0."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def update_masks(model, share: float, seed: int) -> list[torch.Tensor] | None:
    """One seeded random boolean mask per parameter, True on `share` of its
    elements (None: every element may move)."""
    if share >= 1.0:
        return None
    generator = torch.Generator().manual_seed(10_000 + seed)
    return [
        torch.rand(p.shape, generator=generator) < share for p in model.parameters()
    ]


def mask_gradients(parameters, masks: list[torch.Tensor] | None) -> None:
    """Zero the gradient outside each mask: Adam then never moves those elements
    (no weight decay, and their moment estimates stay zero)."""
    if masks is None:
        return
    for parameter, keep in zip(parameters, masks):
        parameter.grad.mul_(keep)


def policy_loss(model, sampled, mask, advantages, group) -> torch.Tensor:
    """Token-mean of -A·log π(completion token) under the current policy."""
    first, cache = prefill(model, sampled.batch, group)
    rest = forward_completions(model, sampled.batch, cache, sampled.tokens, group)
    logits = torch.cat([first, rest[:, :-1]], dim=1)
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, sampled.tokens.unsqueeze(-1)).squeeze(-1)
    return -(advantages[:, None] * token_logp * mask).sum() / mask.sum()


def train_agent(
    base_dir: Path, task_name: str, config: RLConfig, out_dir: Path, log=print
) -> dict:
    """Train one agent from the base and save it (bf16 safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = TASKS[task_name]
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if config.master not in MASTERS or config.save not in SAVES:
        raise ValueError(
            f"rl master: {config.master!r} / save: {config.save!r} must be one of "
            f"{MASTERS}; set them in the config's rl: section"
        )
    if not 0.0 < config.mask <= 1.0:
        raise ValueError(f"rl mask: {config.mask} must be in (0, 1]")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    masks = update_masks(model, config.mask, config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0
    )
    stream = examples(task, "train", config.seed)
    history = []
    started = time.perf_counter()
    for step in range(config.steps):
        batch_examples = [next(stream) for _ in range(config.prompts)]
        model.eval()
        sampled = sample(
            model,
            tokenizer,
            [example.prompt for example in batch_examples],
            MAX_NEW_TOKENS[task_name],
            samples=config.group,
            temperature=config.temperature,
        )
        rewards = torch.tensor(
            [
                task.reward(batch_examples[i // config.group], text)
                for i, text in enumerate(sampled.texts)
            ]
        )
        advantages = group_advantages(rewards, config.group)
        mask = completion_mask(sampled.tokens, tokenizer.eos_token_id)
        updated = bool(advantages.abs().sum() > 0)
        if updated:
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = policy_loss(model, sampled, mask, advantages, config.group)
            loss.backward()
            mask_gradients(model.parameters(), masks)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            if config.master == "bfloat16":
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.copy_(parameter.to(torch.bfloat16))
        record = {
            "step": step + 1,
            "reward": round(rewards.mean().item(), 4),
            "solved": round((rewards == 1).float().mean().item(), 4),
            "updated": updated,
            "seconds": round(time.perf_counter() - started, 1),
        }
        history.append(record)
        log(f"[{task_name}] " + " ".join(f"{k}={v}" for k, v in record.items()))
    model.to(SAVES[config.save]).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    summary = {
        "task": task_name,
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 1),
        "history": history,
    }
    (out_dir / "rl_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
