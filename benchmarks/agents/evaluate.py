"""Greedy accuracy on one held-out split, with a binomial standard error and
each prompt's outcome (so paired comparisons need no second evaluation)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from generation import MAX_NEW_TOKENS, sample
from tasks import TASKS, take


def evaluate_model(
    model_dir: Path, split: str, prompts: int, batch: int, seed: int
) -> dict:
    """{task: {correct, n, accuracy, se, reward, reward_se, per_prompt}} for one
    checkpoint on `prompts` prompts per task of `split` ('validation' or 'test').

    accuracy counts exact answers (per_prompt: 1 exact, 0 not, in prompt order);
    reward is the mean training reward, which gives the tool task partial credit.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    scores = {}
    for name, task in TASKS.items():
        held_out = take(task, split, seed, prompts)
        rewards = []
        for start in range(0, len(held_out), batch):
            chunk = held_out[start : start + batch]
            texts = sample(
                model,
                tokenizer,
                [e.prompt for e in chunk],
                MAX_NEW_TOKENS[name],
                stop=task.answered,
            ).texts
            rewards += [task.reward(e, text) for e, text in zip(chunk, texts)]
        n = len(rewards)
        per_prompt = [int(r == 1.0) for r in rewards]
        accuracy = sum(per_prompt) / n
        reward = sum(rewards) / n
        spread = sum((r - reward) ** 2 for r in rewards) / max(n - 1, 1)
        scores[name] = {
            "correct": sum(per_prompt),
            "n": n,
            "accuracy": accuracy,
            "se": math.sqrt(accuracy * (1 - accuracy) / n),
            "reward": reward,
            "reward_se": math.sqrt(spread / n),
            "per_prompt": per_prompt,
        }
    return scores
