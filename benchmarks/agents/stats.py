"""The numbers that say which regime the agents are in, and whether a merge
really beats the best baseline.

`support_statistics` streams the checkpoints once per tensor: each agent's
changed elements (bf16 value != base), pairwise overlaps next to what
independent supports with the same per-tensor densities would give, unique
shares observed vs expected, and how much of each agent's task vector every
merge keeps, <τ_merge, τ_t> / <τ_t, τ_t> (the cheap number of issue 19 item 6).
`paired_bootstrap` compares two models on the same test prompts.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from safetensors import safe_open
from tasks import TASKS


def _tensors(model_dir: Path) -> safe_open:
    return safe_open(str(model_dir / "model.safetensors"), "pt")


def support_statistics(
    base_dir: Path, agents: dict[str, Path], merges: dict[str, Path]
) -> dict:
    """Densities, overlaps (observed, independent-expected, lift), unique shares
    (observed, expected) and per-merge retention of each agent's task vector."""
    names = list(agents)
    pairs = list(itertools.combinations(names, 2))
    changed = dict.fromkeys(names, 0)
    unique = dict.fromkeys(names, 0.0)
    unique_expected = dict.fromkeys(names, 0.0)
    overlap = dict.fromkeys(pairs, 0)
    overlap_expected = dict.fromkeys(pairs, 0.0)
    norm = dict.fromkeys(names, 0.0)
    dot = {(m, t): 0.0 for m in merges for t in names}
    elements = 0
    base = _tensors(base_dir)
    opened = {name: _tensors(path) for name, path in {**agents, **merges}.items()}
    for tensor in base.keys():
        theta0 = base.get_tensor(tensor)
        n = theta0.numel()
        elements += n
        masks, taus = {}, {}
        for name in names:
            value = opened[name].get_tensor(tensor)
            masks[name] = value != theta0
            taus[name] = value.double() - theta0.double()
        density = {name: masks[name].sum().item() / n for name in names}
        count = sum(masks[name].int() for name in names)
        for name in names:
            changed[name] += int(masks[name].sum())
            unique[name] += int((masks[name] & (count == 1)).sum())
            others = [1 - density[o] for o in names if o != name]
            unique_expected[name] += (
                n * density[name] * float(torch.tensor(others).prod())
            )
            norm[name] += float((taus[name] * taus[name]).sum())
        for a, b in pairs:
            overlap[(a, b)] += int((masks[a] & masks[b]).sum())
            overlap_expected[(a, b)] += n * density[a] * density[b]
        for merge in merges:
            tau = opened[merge].get_tensor(tensor).double() - theta0.double()
            for name in names:
                dot[(merge, name)] += float((tau * taus[name]).sum())
    agents_out = {
        name: {
            "changed": changed[name],
            "density": changed[name] / elements,
            "unique_share": unique[name] / changed[name] if changed[name] else 0.0,
            "unique_share_expected": (
                unique_expected[name] / changed[name] if changed[name] else 0.0
            ),
        }
        for name in names
    }
    pairs_out = {}
    for a, b in pairs:
        union = changed[a] + changed[b] - overlap[(a, b)]
        union_expected = changed[a] + changed[b] - overlap_expected[(a, b)]
        pairs_out[f"{a}-{b}"] = {
            "overlap": overlap[(a, b)],
            "overlap_expected": overlap_expected[(a, b)],
            "lift": overlap[(a, b)] / overlap_expected[(a, b)]
            if overlap_expected[(a, b)]
            else None,
            "jaccard": overlap[(a, b)] / union if union else 0.0,
            "jaccard_expected": overlap_expected[(a, b)] / union_expected
            if union_expected
            else 0.0,
        }
    retention = {  # None for an agent that changed nothing (no task vector)
        merge: {
            name: dot[(merge, name)] / norm[name] if norm[name] else None
            for name in names
        }
        for merge in merges
    }
    return {
        "elements": elements,
        "agents": agents_out,
        "pairs": pairs_out,
        "retention": retention,
    }


def paired_bootstrap(
    scores: dict,
    reference: dict,
    resamples: int,
    seed: int,
    tasks: tuple[str, ...] = tuple(TASKS),
) -> dict:
    """Average-over-`tasks` exact accuracy of `scores` minus `reference` on the
    same prompts, with a 95 % percentile CI from resampling prompts within each
    task (one task: an agent's gain on its own task)."""
    generator = torch.Generator().manual_seed(seed)
    observed = 0.0
    draws = torch.zeros(resamples, dtype=torch.float64)
    for task in tasks:
        diff = torch.tensor(scores[task]["per_prompt"], dtype=torch.float64)
        diff -= torch.tensor(reference[task]["per_prompt"], dtype=torch.float64)
        observed += diff.mean().item() / len(tasks)
        picks = torch.randint(len(diff), (resamples, len(diff)), generator=generator)
        draws += diff[picks].mean(dim=1) / len(tasks)
    low, high = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return {
        "difference": observed,
        "ci95": [low.item(), high.item()],
        "resamples": resamples,
    }
