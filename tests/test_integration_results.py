"""mergekit_ram.integration.results: strict JSON (issue finding 10)."""

from __future__ import annotations

import json
import math

from mergekit_ram.integration.results import strict_json


def test_report_json_is_strict():
    document = {"a": [float("inf"), 1.5], "b": {"c": float("nan")}, "d": "x"}
    text = json.dumps(strict_json(document), allow_nan=False)
    assert json.loads(text) == {"a": [None, 1.5], "b": {"c": None}, "d": "x"}
    assert math.isfinite(strict_json(2.0))
