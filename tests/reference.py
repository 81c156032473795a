"""A dense, obviously-correct RAM / RAM+ written from docs/spec.md alone.

It shares no code with mergekit_ram: whole tensors are stacked, counts are
taken over the whole model at once, λ follows the spec's formulas literally.
Shared elements are summed as Σ_active (τ_t / c) in task order, the order
the spec's "mean of τ over active tasks" takes in stock mergekit, so float32
results can be compared exactly.
"""

from __future__ import annotations

import torch


def counts(base, tasks, epsilon):
    """Per tensor: stacked τ (float32), masks m, overlap counts c."""
    out = {}
    for name, b in base.items():
        tau = torch.stack([t[name].float() - b.float() for t in tasks])
        m = tau.abs() > epsilon
        out[name] = (tau, m, m.sum(0))
    return out


def csu(per_tensor, n):
    """Whole-model C, S, U and k-way histogram per task, by definition."""
    C, S, hist = [0] * n, [0] * n, [[0] * n for _ in range(n)]
    for _tau, m, c in per_tensor.values():
        for t in range(n):
            C[t] += int(m[t].sum())
            S[t] += int((m[t] & (c >= 2)).sum())
            for k in range(n):
                hist[t][k] += int((m[t] & (c == k + 1)).sum())
    U = [C[t] - S[t] for t in range(n)]
    return C, S, U, hist


def lam(C, S, U, r, alpha, saturation):
    if C == 0:
        return 1.0
    if U == 0:
        return 1 + r * alpha if saturation == "clip" else 1 + r
    rho = S / U
    if saturation == "clip":
        return 1 + r * min(max(rho, 0.0), alpha)
    return 1 + r * rho / (1 + rho)


def merge(
    base,
    tasks,
    *,
    epsilon=1e-5,
    r=0.0,
    alpha=2.0,
    saturation="clip",
    statistics="global",
    unique_scale=None,
    shared="mean",
    density=0.1,
    out_dtype=None,
):
    """Merged state dict (out_dtype, default base's) and the global λ per task.

    shared: "mean" (RAM), "ties" (the authors' arm-ties on shared elements,
    see ties_region) or "base" (shared elements keep the base's value).
    """
    n = len(tasks)
    per_tensor = counts(base, tasks, epsilon)
    C, S, U, _ = csu(per_tensor, n)
    global_lam = [lam(C[t], S[t], U[t], r, alpha, saturation) for t in range(n)]
    merged = {}
    for name, (tau, m, c) in per_tensor.items():
        if statistics == "tensor":
            Ct, St, Ut, _ = csu({name: (tau, m, c)}, n)
            lams = [lam(Ct[t], St[t], Ut[t], r, alpha, saturation) for t in range(n)]
        else:
            lams = list(global_lam)
        if unique_scale is not None:
            lams = [u if u is not None else x for u, x in zip(unique_scale, lams)]
        unique = c == 1
        delta = torch.zeros_like(tau[0])
        for t in range(n):
            mean = tau[t] / c.clamp(min=1).float()
            contrib = torch.where(unique, tau[t] * lams[t], mean)
            delta = delta + torch.where(m[t], contrib, torch.zeros_like(contrib))
        result = base[name].float() + delta
        if shared == "base":
            result = torch.where(c >= 2, base[name].float(), result)
        elif shared == "ties" and bool((c >= 2).any()):
            region, value = ties_region(tau, m, c, density)
            result[region] = base[name].float()[region] + value
        merged[name] = result.to(out_dtype or base[name].dtype)
    return merged, global_lam


def intersections(per_tensor, n):
    """Whole-model |m_s ∧ m_t| for every pair of tasks (diagonal: C_t)."""
    inter = [[0] * n for _ in range(n)]
    for _tau, m, _c in per_tensor.values():
        for s in range(n):
            for t in range(n):
                inter[s][t] += int((m[s] & m[t]).sum())
    return inter


def jaccard(inter):
    """Jaccard overlap I / (C_s + C_t − I) of the change masks, 0 if both empty."""
    n = len(inter)
    out = [[0.0] * n for _ in range(n)]
    for s in range(n):
        for t in range(n):
            union = inter[s][s] + inter[t][t] - inter[s][t]
            out[s][t] = inter[s][t] / union if union else 0.0
    return out


def ties_region(tau, m, c, density):
    """(mask of the shared elements, TIES delta on them), from the definition.

    Per task, its masked τ over the region is kept where |v| is at least the
    k-th smallest |v| of the region (sorted, 1-based), k = int((1 − density)·n),
    nothing trimmed for k < 1. Sign per element: + if the kept positives
    outweigh the kept negatives, − if the reverse, none if equal. Delta: the
    kept non-zero values of that sign summed in task order over their count
    (0 when there are none).
    """
    region = c >= 2
    n = int(region.sum())
    v = torch.where(m, tau, torch.zeros_like(tau))[:, region]
    k = int((1 - density) * n)
    if k >= 1:
        kth = v.abs().sort(dim=1).values[:, k - 1 : k]
        v = torch.where(v.abs() >= kth, v, torch.zeros_like(v))
    pos = sum(v[t].clamp(min=0) for t in range(len(v)))
    neg = sum((-v[t]).clamp(min=0) for t in range(len(v)))
    sign = torch.where(pos > neg, 1.0, torch.where(neg > pos, -1.0, 0.0))
    keep = (v != 0) & (torch.sign(v) == sign)
    total = torch.zeros(n)
    for t in range(len(v)):
        total = total + torch.where(keep[t], v[t], torch.zeros(n))
    return region, total / keep.sum(0).clamp(min=1).float()
