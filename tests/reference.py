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
    C = [0] * n
    S = [0] * n
    hist = [[0] * n for _ in range(n)]
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
):
    """Merged state dict (base dtype) and the global λ per task."""
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
            contrib = torch.where(
                unique, tau[t] * lams[t], tau[t] / c.clamp(min=1).float()
            )
            delta = delta + torch.where(m[t], contrib, torch.zeros_like(contrib))
        merged[name] = (base[name].float() + delta).to(base[name].dtype)
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
