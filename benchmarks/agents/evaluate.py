"""Greedy accuracy on held-out prompts, with a binomial standard error."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from generation import MAX_NEW_TOKENS, sample
from tasks import TASKS, take


def evaluate_model(model_dir: Path, prompts: int, batch: int, seed: int) -> dict:
    """{task: {correct, n, accuracy, se, reward, reward_se}} for one checkpoint.

    accuracy counts exact answers; reward is the mean training reward, which
    gives the tool task partial credit (valid call format, right function).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    scores = {}
    for name, task in TASKS.items():
        held_out = take(task, "test", seed, prompts)
        rewards = []
        for start in range(0, len(held_out), batch):
            chunk = held_out[start : start + batch]
            texts = sample(
                model, tokenizer, [e.prompt for e in chunk], MAX_NEW_TOKENS[name]
            ).texts
            rewards += [task.reward(e, text) for e, text in zip(chunk, texts)]
        n = len(rewards)
        correct = sum(r == 1.0 for r in rewards)
        accuracy = correct / n
        reward = sum(rewards) / n
        spread = sum((r - reward) ** 2 for r in rewards) / max(n - 1, 1)
        scores[name] = {
            "correct": correct,
            "n": n,
            "accuracy": accuracy,
            "se": math.sqrt(accuracy * (1 - accuracy) / n),
            "reward": reward,
            "reward_se": math.sqrt(spread / n),
        }
    return scores
