"""ScaleRule: the RAM+ λ formulas and their edge cases (docs/spec.md, "RAM+ scale")."""

from __future__ import annotations

import itertools
import math

import pytest
import reference

from mergekit_ram.scale import ScaleRule

COUNTS = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1), (1, 2), (5, 2), (3, 7), (1000, 1)]
RULES = [
    ScaleRule(r=r, alpha=alpha, saturation=saturation)
    for r, alpha, saturation in itertools.product(
        [0.0, 0.1, 0.5, 3.0], [0.0, 0.5, 1.0, 2.0, 10.0], ["clip", "soft"]
    )
]


def test_defaults_to_clip():
    assert ScaleRule(r=0.1, alpha=2.0).saturation == "clip"


@pytest.mark.parametrize("shared,unique", [(2, 1), (1, 2), (5, 2), (3, 7), (4, 4)])
@pytest.mark.parametrize("r,alpha", [(0.1, 2.0), (0.5, 1.0), (0.2, 10.0)])
def test_clip_formula(shared, unique, r, alpha):
    rho = shared / unique
    expected = 1 + r * min(rho, alpha)
    got = ScaleRule(r=r, alpha=alpha).scale(shared, unique)
    assert got == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("shared,unique", [(2, 1), (1, 2), (5, 2), (3, 7), (4, 4)])
@pytest.mark.parametrize("r", [0.1, 0.5, 2.0])
def test_soft_formula(shared, unique, r):
    rho = shared / unique
    got = ScaleRule(r=r, alpha=0.5, saturation="soft").scale(shared, unique)
    # Both forms of the spec: 1 + r·ρ/(1+ρ) = 1 + r·S/C; alpha plays no part.
    assert got == pytest.approx(1 + r * rho / (1 + rho), rel=1e-14)
    assert got == pytest.approx(1 + r * shared / (shared + unique), rel=1e-15)
    no_alpha = ScaleRule(r=r, alpha=0.0, saturation="soft").scale(shared, unique)
    assert no_alpha == got


@pytest.mark.parametrize("saturation", ["clip", "soft"])
@pytest.mark.parametrize("r", [0.0, 0.1, 5.0])
def test_nothing_changed_gives_one(saturation, r):
    assert ScaleRule(r=r, alpha=2.0, saturation=saturation).scale(0, 0) == 1.0


@pytest.mark.parametrize("shared", [1, 7, 10**9])
def test_no_unique_gives_the_limit(shared):
    clip = ScaleRule(r=0.1, alpha=2.0)
    soft = ScaleRule(r=0.1, alpha=2.0, saturation="soft")
    assert clip.scale(shared, 0) == clip.limit() == pytest.approx(1 + 0.1 * 2.0)
    assert soft.scale(shared, 0) == soft.limit() == pytest.approx(1 + 0.1)


def test_limit_is_the_large_rho_value():
    clip = ScaleRule(r=0.3, alpha=1.5)
    soft = ScaleRule(r=0.3, alpha=1.5, saturation="soft")
    assert clip.scale(10**12, 1) == pytest.approx(clip.limit(), rel=1e-15)
    assert soft.scale(10**12, 1) == pytest.approx(soft.limit(), rel=1e-9)


def test_alpha_clips_rho():
    rule = ScaleRule(r=0.1, alpha=2.0)
    assert rule.scale(6, 2) == pytest.approx(1 + 0.1 * 2.0)  # ρ = 3 > α
    assert rule.scale(4, 2) == pytest.approx(1 + 0.1 * 2.0)  # ρ = α
    assert rule.scale(3, 2) == pytest.approx(1 + 0.1 * 1.5)  # ρ < α
    assert rule.scale(6, 2) == rule.scale(100, 1)
    assert rule.scale(3, 2) < rule.scale(6, 2)
    assert ScaleRule(r=0.1, alpha=0.0).scale(6, 2) == 1.0


@pytest.mark.parametrize("saturation", ["clip", "soft"])
@pytest.mark.parametrize("shared,unique", COUNTS)
def test_r_zero_gives_one(saturation, shared, unique):
    rule = ScaleRule(r=0.0, alpha=2.0, saturation=saturation)
    assert rule.scale(shared, unique) == 1.0


def test_no_shared_gives_one():
    for rule in RULES:
        assert rule.scale(0, 5) == 1.0


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_never_raises_and_matches_reference(rule):
    for shared, unique in COUNTS:
        got = rule.scale(shared, unique)
        assert math.isfinite(got)
        assert got >= 1.0
        assert got <= rule.limit() + 1e-12
        expected = reference.lam(
            shared + unique, shared, unique, rule.r, rule.alpha, rule.saturation
        )
        assert got == pytest.approx(expected, rel=1e-14, abs=1e-15)


def test_monotone_in_shared_fraction():
    for rule in RULES:
        values = [rule.scale(shared, 10) for shared in range(0, 60, 3)]
        assert values == sorted(values)


def test_is_a_frozen_value():
    rule = ScaleRule(r=0.1, alpha=2.0)
    assert rule == ScaleRule(r=0.1, alpha=2.0, saturation="clip")
    assert hash(rule) == hash(ScaleRule(r=0.1, alpha=2.0))
    with pytest.raises(AttributeError):
        rule.r = 0.2
