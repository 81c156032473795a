"""Writing an analysis report: report.json, the figures and report.md."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from mergekit_ram.analysis import figures
from mergekit_ram.analysis.render import render_markdown
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.output_folder import plain_json
from mergekit_ram.integration.statistics import strict_json

REPORT_JSON, REPORT_MD = "report.json", "report.md"
REPORT_LIMIT = 64 << 20  # bytes: a report.json of ours is far smaller


def check_report_folder(out_dir: str) -> None:
    """Refuse a folder holding a file the report would replace that an
    earlier report did not write (we recognise one by its report.json; all
    of them plain files): a user's own report.md is never overwritten, nor
    written through a link."""
    names = [REPORT_JSON, REPORT_MD, *figures.FIGURES]
    taken = [n for n in names if os.path.lexists(os.path.join(out_dir, n))]
    if not taken:
        return
    if all(stat.S_ISREG(os.lstat(os.path.join(out_dir, n)).st_mode) for n in taken):
        document = plain_json(os.path.join(out_dir, REPORT_JSON), REPORT_LIMIT)
        if document is not None and {"schema_version", "verdict"} <= set(document):
            return
    raise RAMInputError(
        f"The report folder {out_dir} holds {', '.join(taken)}, which no "
        "mergekit-ram report wrote there, and the report would replace "
        f"{'it' if len(taken) == 1 else 'them'}. Choose another folder for "
        "--report / --out, or move those files away; nothing was written."
    )


def write_report(report: Mapping[str, Any], out_dir: str) -> tuple[list[str], str]:
    """Write report.json, the figures and report.md; returns (paths, message).

    A folder that cannot take them (a full disk, no permission) is one
    RAMInputError naming it: the report was shown above, nothing else is lost.
    """
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, REPORT_JSON), "w", encoding="utf-8") as handle:
            json.dump(strict_json(report), handle, indent=2, allow_nan=False)
            handle.write("\n")
        names = figures.write_figures(report, out_dir)
        lines = ["", "## Figures", ""] + [
            f"![{os.path.splitext(n)[0]}]({n})" for n in names
        ]
        note = None
        if not names:
            note = (
                "Figures skipped: matplotlib is not installed. Install the plots "
                f"extra to get them: {figures.INSTALL_HINT}"
            )
            lines.append(note)
        lines += [
            "",
            f"Data: `{REPORT_JSON}` (schema_version {report['schema_version']}).",
        ]
        with open(os.path.join(out_dir, REPORT_MD), "w", encoding="utf-8") as handle:
            handle.write(render_markdown(report) + "\n".join(lines) + "\n")
    except OSError as error:
        raise RAMInputError(
            f"Writing the report into {out_dir} failed ({error.strerror}"
            f"{': ' + str(error.filename) if error.filename else ''}). The report "
            "is printed above (and a merge written before it is complete); "
            "free space or choose another folder for --report / --out, then "
            "run the command again."
        ) from error
    written = [REPORT_JSON, REPORT_MD, *names]
    message = f"Report written to {out_dir}: " + ", ".join(written)
    return [os.path.join(out_dir, n) for n in written], message + (
        f"\n{note}" if note else ""
    )
