"""Chat-formatted batched sampling that prefills each prompt once.

RL samples a group of completions per prompt; running the prompt once and
repeating its KV cache across the group (instead of once per sample, as
`generate(num_return_sequences=...)` does) is what makes CPU RL affordable.
Training reuses `prefill` + `forward_completions` so the policy gradient sees
exactly the positions and masks the sampler used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_NEW_TOKENS = {"math": 24, "tool": 40, "recall": 16}


def encode_prompts(tokenizer, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Left-padded chat-template encodings (completions are appended on the right)."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for prompt in prompts
    ]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def prefill(model, batch: dict[str, torch.Tensor], repeats: int):
    """Run the prompts once; return last-position logits and the KV cache, each
    repeated `repeats` times per prompt (rows i·repeats … i·repeats + repeats-1)."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model.model(
        input_ids=batch["input_ids"],
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
    )
    cache = out.past_key_values
    cache.batch_repeat_interleave(repeats)
    last = model.lm_head(out.last_hidden_state[:, -1:]).float()
    return last.repeat_interleave(repeats, dim=0), cache


def forward_completions(model, batch, cache, completions, repeats):
    """Logits after each completion token given the cached prompts (B·repeats rows)."""
    prompt_mask = batch["attention_mask"].repeat_interleave(repeats, dim=0)
    start = prompt_mask.sum(dim=1, keepdim=True)
    steps = torch.arange(completions.shape[1]).unsqueeze(0)
    mask = torch.cat([prompt_mask, torch.ones_like(completions)], dim=1)
    out = model.model(
        input_ids=completions,
        attention_mask=mask,
        position_ids=start + steps,
        use_cache=True,
        **{_cache_argument(model.model): cache},
    )
    return model.lm_head(out.last_hidden_state).float()


def _cache_argument(module) -> str:
    """The name the model's forward takes the KV cache by: `cache` in
    transformers 5 (which deprecates `past_key_values`), else the old one."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@dataclass(frozen=True)
class Sampled:
    """Completions of a batch: token ids (padded with EOS), their texts."""

    batch: dict[str, torch.Tensor]
    tokens: torch.Tensor
    texts: list[str]


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    *,
    samples: int = 1,
    temperature: float = 0.0,
    stop: Callable[[str], bool] | None = None,
) -> Sampled:
    """`samples` completions per prompt: greedy at temperature 0, else sampled.

    A row ends at EOS, or once `stop(text so far)` holds (evaluation: the answer
    is complete, what follows cannot change its score); ended rows leave the
    batch, so a long straggler does not keep paying for the whole batch."""
    batch = encode_prompts(tokenizer, prompts)
    logits, cache = prefill(model, batch, samples)
    mask = batch["attention_mask"].repeat_interleave(samples, dim=0)
    position = mask.sum(dim=1, keepdim=True)
    eos = tokenizer.eos_token_id
    rows = torch.arange(position.shape[0])
    ids = torch.full((len(rows), max_new_tokens), eos, dtype=torch.long)
    width = 0
    for step in range(max_new_tokens):
        last = logits[:, -1]
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)
            token = torch.multinomial(probs, 1).squeeze(1)
        else:
            token = last.argmax(dim=-1)
        ids[rows, step] = token
        width = step + 1
        ended = token == eos
        if stop is not None:
            texts = tokenizer.batch_decode(ids[rows, :width], skip_special_tokens=True)
            ended |= torch.tensor([stop(text) for text in texts])
        if bool(ended.all()):
            break
        if bool(ended.any()):
            keep = (~ended).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, token = rows[keep], token[keep]
            mask, position = mask[keep], position[keep]
        mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
        out = model.model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            **{_cache_argument(model.model): cache},
        )
        position = position + 1
        cache = out.past_key_values
        logits = model.lm_head(out.last_hidden_state).float()
    ids = ids[:, :width]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Sampled(batch, ids, texts)
