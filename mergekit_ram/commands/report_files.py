"""Writing an analysis report: report.json, the figures and report.md."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

from mergekit_ram.analysis import figures
from mergekit_ram.analysis.render import render_markdown
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.output_folder import plain_json
from mergekit_ram.integration.statistics import strict_json

REPORT_JSON, REPORT_MD = "report.json", "report.md"
REPORT_LIMIT = 64 << 20  # bytes: a report.json of ours is far smaller
NO_FIGURES = (
    "Figures skipped: matplotlib is not installed. Install the plots extra to "
    f"get them: {figures.INSTALL_HINT}"
)


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

    They are written into a staging folder inside `out_dir`, then renamed into
    it, report.json first: an interrupted write leaves no file, or files a
    report of ours is recognised by. A folder that cannot take them (a full
    disk, no permission) is one RAMInputError naming it: the report was shown
    above, nothing else is lost.
    """
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".report-", dir=out_dir) as staged:
            written = [REPORT_JSON, REPORT_MD, *_write(report, staged)]
            for name in written:
                os.replace(os.path.join(staged, name), os.path.join(out_dir, name))
    except OSError as error:
        raise RAMInputError(
            f"Writing the report into {out_dir} failed ({error.strerror}"
            f"{': ' + str(error.filename) if error.filename else ''}). The report "
            "is printed above (and a merge written before it is complete); "
            "free space or choose another folder for --report / --out, then "
            "run the command again."
        ) from error
    message = f"Report written to {out_dir}: " + ", ".join(written)
    return [os.path.join(out_dir, n) for n in written], message + (
        "" if written[2:] else f"\n{NO_FIGURES}"
    )


def _write(report: Mapping[str, Any], folder: str) -> list[str]:
    """report.json, the figures and report.md in `folder`; the figures' names."""
    with open(os.path.join(folder, REPORT_JSON), "w", encoding="utf-8") as handle:
        json.dump(strict_json(report), handle, indent=2, allow_nan=False)
        handle.write("\n")
    names = figures.write_figures(report, folder)
    lines = ["", "## Figures", ""] + [
        f"![{os.path.splitext(n)[0]}]({n})" for n in names
    ]
    lines += [] if names else [NO_FIGURES]
    lines += ["", f"Data: `{REPORT_JSON}` (schema_version {report['schema_version']})."]
    with open(os.path.join(folder, REPORT_MD), "w", encoding="utf-8") as handle:
        handle.write(render_markdown(report) + "\n".join(lines) + "\n")
    return names
