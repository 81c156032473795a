"""Writing an analysis report: report.json, the figures and report.md."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from mergekit_ram.analysis import figures
from mergekit_ram.analysis.render import REPORT_JSON, render_markdown
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.output_folder import plain_json
from mergekit_ram.integration.statistics import strict_json

REPORT_MD = "report.md"
REPORT_LIMIT = 64 << 20  # bytes: a report.json of ours is far smaller


def check_report_folder(out_dir: str) -> None:
    """Refuse a folder holding a file the report would replace that an
    earlier report did not write (we recognise one by its report.json; all
    of them plain files): a user's own report.md is never overwritten, nor
    written through a link."""
    names = [REPORT_JSON, REPORT_MD, *figures.FIGURES]
    taken = [n for n in names if os.path.lexists(os.path.join(out_dir, n))]
    plain = all(stat.S_ISREG(os.lstat(os.path.join(out_dir, n)).st_mode) for n in taken)
    if not taken or (plain and _ours(os.path.join(out_dir, REPORT_JSON))):
        return
    raise RAMInputError(
        f"The report folder {out_dir} holds {', '.join(taken)}, which no "
        "mergekit-ram report wrote there, and the report would replace "
        f"{'it' if len(taken) == 1 else 'them'}. Choose another folder for "
        "--report / --out, or move those files away; nothing was written."
    )


def _ours(path: str) -> bool:
    """Whether path is a report.json an analysis wrote (its own keys)."""
    document = plain_json(path, REPORT_LIMIT)
    return document is not None and {"schema_version", "verdict"} <= set(document)


def write_report(report: Mapping[str, Any], out_dir: str) -> tuple[list[str], str]:
    """Write report.json, the figures and report.md; returns (paths, message).

    A folder that cannot take them (a full disk, no permission) is one
    RAMInputError naming it: the report was shown above, nothing else is lost.
    """
    try:
        return _write(report, out_dir)
    except OSError as error:
        raise RAMInputError(
            f"Writing the report into {out_dir} failed ({error.strerror}"
            f"{': ' + str(error.filename) if error.filename else ''}). The report "
            "is printed above (and a merge written before it is complete); "
            "free space or choose another folder for --report / --out, then "
            "run the command again."
        ) from error


def _write(report: Mapping[str, Any], out_dir: str) -> tuple[list[str], str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, REPORT_JSON)]
    with open(paths[0], "w", encoding="utf-8") as handle:
        json.dump(strict_json(report), handle, indent=2, allow_nan=False)
        handle.write("\n")
    note = None
    if figures.available():
        names = figures.write_figures(report, out_dir)
    else:
        names = []
        note = (
            "Figures skipped: matplotlib is not installed. Install the plots "
            f"extra to get them: {figures.INSTALL_HINT}"
        )
    md = os.path.join(out_dir, REPORT_MD)
    with open(md, "w", encoding="utf-8") as handle:
        handle.write(render_markdown(report, names, note))
    paths += [md] + [os.path.join(out_dir, name) for name in names]
    message = f"Report written to {out_dir}: " + ", ".join(
        os.path.basename(p) for p in paths
    )
    if note:
        message += "\n" + note
    return paths, message
