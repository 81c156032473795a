"""Greedy accuracy on held-out prompts, with a binomial standard error."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from generation import MAX_NEW_TOKENS, sample
from tasks import TASKS, take


def evaluate_model(model_dir: Path, prompts: int, batch: int, seed: int) -> dict:
    """{task: {correct, n, accuracy, se, reward}} for one checkpoint."""
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
        correct = sum(r == 1.0 for r in rewards)
        accuracy = correct / len(rewards)
        scores[name] = {
            "correct": correct,
            "n": len(rewards),
            "accuracy": accuracy,
            "se": math.sqrt(accuracy * (1 - accuracy) / len(rewards)),
            "reward": sum(rewards) / len(rewards),
        }
    return scores
