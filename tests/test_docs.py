"""docs/*.md name only code that exists: every `core.…`, `integration.…`,
`analysis.…` or `commands.…` reference imports (a module) or resolves by
getattr (a module's function, class or attribute)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
REFERENCE = re.compile(r"\b(?:core|integration|analysis|commands)(?:\.[A-Za-z_]\w*)+")


def references() -> list[tuple[str, str]]:
    found = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        found += [(path.name, m.group(0)) for m in REFERENCE.finditer(text)]
    return found


def resolve(dotted: str) -> object:
    """mergekit_ram.<dotted>: the longest importable module, then attributes."""
    parts = f"mergekit_ram.{dotted}".split(".")
    for size in range(len(parts), 1, -1):
        try:
            target = importlib.import_module(".".join(parts[:size]))
        except ModuleNotFoundError:
            continue
        for name in parts[size:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(dotted)


def test_docs_reference_code():
    found = references()
    assert len(found) >= 10


@pytest.mark.parametrize("where, dotted", references())
def test_reference_exists(where, dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{where} names {dotted}, which does not exist: {error}")


def test_rho_is_null_by_one_rule_everywhere():
    """outputs.md says what report_schema.md says: null only when U = 0 and
    S > 0 (ρ = ∞), which is what integration.statistics.task_rows writes."""
    rule = "U = 0 and S > 0"
    schema = (DOCS / "report_schema.md").read_text(encoding="utf-8").splitlines()
    (row,) = [line for line in schema if line.startswith("| `rho` |")]
    assert rule in row
    outputs = " ".join((DOCS / "outputs.md").read_text(encoding="utf-8").split())
    said = re.findall(r"`rho` is `null`[^.;]*", outputs)
    assert said and all(rule in s for s in said)
