"""`mergekit-ram merge` and `analyze`: the commands that take mergekit's options.

mergekit's option module imports torch and transformers (seconds), so these
two live apart from the command group (`cli`), which imports this module
only when one of them runs or shows its help.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options
from pydantic import ValidationError

from mergekit_ram.commands.cli import COMMANDS
from mergekit_ram.commands.install import install
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.methods import METHODS
from mergekit_ram.integration.validation import check_config, written_document

PROBLEM_LIMIT = 5  # schema problems listed, the rest counted


def _load(
    config_file: str, command: str = "merge"
) -> tuple[MergeConfiguration, str, Any]:
    """The configuration, its text and the document as written; a
    CONFIG_FILE that is no text (a checkpoint given in its place), bad YAML
    or a schema error (pydantic's messages, at their keys) is a RAMInputError."""
    try:
        source = Path(config_file).read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        usage = "OUT_PATH" if command == "merge" else "[--out DIR]"
        raise RAMInputError(
            f"CONFIG_FILE {config_file} is not a text file (byte {error.start} is "
            "not UTF-8): it is no YAML configuration. The order is: mergekit-ram "
            f"{command} CONFIG_FILE {usage}."
        ) from None
    try:
        document = written_document(source)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or " ".join(str(error).split())
        raise RAMInputError(
            f"{config_file} is not valid YAML{at}: {problem}."
        ) from None
    try:
        return MergeConfiguration.model_validate(document), source, document
    except ValidationError as error:
        problems = [
            "".join(
                f"[{p}]" if isinstance(p, int) else f".{p}" for p in item["loc"]
            ).lstrip(".")
            + f": {item['msg']}"
            for item in error.errors(include_url=False)
        ]
    except RuntimeError as error:  # mergekit's own validators raise these
        problems = [str(error)]
    more = len(problems) - PROBLEM_LIMIT
    problems = problems[:PROBLEM_LIMIT] + [f"and {more} more"] * (more > 0)
    raise RAMInputError(
        f"{config_file} is not a valid mergekit configuration ({examples_hint()}):\n"
        + "\n".join(f"- {problem}" for problem in problems)
    )


def examples_hint() -> str:
    """Where working configurations are, from wherever the user runs us."""
    folder = Path(__file__).resolve().parents[2] / "example_configs"
    where = str(folder) if folder.is_dir() else "example_configs/ in the repository"
    return f"{where} holds working RAM and RAM+ configurations"


def _finite_number(
    _context: click.Context, parameter: click.Parameter, value: float | None
) -> float | None:
    """A number option passes the checks its YAML key does (the method's type)."""
    spec = next(s for s in METHODS[0].spec.parameters if s.name == parameter.name)
    try:
        return None if value is None else spec.validate(value)
    except ValidationError as error:
        raise click.BadParameter(error.errors()[0]["msg"]) from None


def _refuse_report_folder(config: Any, folder: str | None) -> None:
    """A report folder gets OUT's path checks before any weight is read: a
    folder that can be made, never one that adds files to an input."""
    if folder is not None:
        from mergekit_ram.commands.report_files import check_report_folder
        from mergekit_ram.integration.output_folder import resolve_output
        from mergekit_ram.integration.publishing import refuse_input_folder

        resolve_output(folder, "report folder")
        refuse_input_folder(config, folder, "report folder")
        check_report_folder(folder)


def _emit(report: dict, out_dir: str | None) -> None:
    from mergekit_ram.analysis.render import render_markdown
    from mergekit_ram.commands.report_files import write_report

    click.echo(render_markdown(report), nl=False)
    if out_dir is not None:
        _paths, message = write_report(report, out_dir)
        click.echo(message)


@click.command("merge", cls=PrettyPrintHelp, help=COMMANDS["merge"].help)
@click.argument("config_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path", type=click.Path())
@click.option(
    "--report",
    "report_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Also write the analyze report here, from the merge's own statistics.",
)
@add_merge_options
def merge(
    merge_options: MergeOptions,
    config_file: str,
    out_path: str,
    report_dir: str | None,
) -> None:
    from mergekit_ram.commands.api import run_merge

    install()
    merge_options.apply_global_options()
    config, source, _document = _load(config_file)
    _refuse_report_folder(config, report_dir)
    if report_dir is None:
        run_merge(config, out_path, options=merge_options, config_source=source)
        return

    from mergekit_ram.analysis.report import build_report
    from mergekit_ram.commands.analysis import merge_with_analysis

    analysis = merge_with_analysis(
        config, out_path, merge_options, source, echo=click.echo
    )
    _emit(build_report(analysis), report_dir)


# The MergeOptions fields analyze reads: where and how models are found and
# loaded (mergekit's planner and loader cache), where the statistics pass
# computes, and logging. The others shape a merge's execution or its output
# (shards, model card, tokenizer copy, seed, multi-GPU, writer threads).
ANALYZE_OPTIONS = frozenset(
    "allow_crimes unsafe_truncate_embeddings transformers_cache lora_merge_cache "
    "lora_merge_dtype trust_remote_code lazy_unpickle cuda device low_cpu_memory "
    "read_to_gpu num_threads verbosity quiet".split()
)


def _analyze_options_only(command: click.Command) -> click.Command:
    """`command` without the merge options analyze would ignore: an option it
    accepts is one it uses, and any other is a usage error."""
    ignored = set(MergeOptions.model_fields) - ANALYZE_OPTIONS
    command.params = [p for p in command.params if p.name not in ignored]
    return command


@_analyze_options_only
@click.command("analyze", cls=PrettyPrintHelp, help=COMMANDS["analyze"].help)
@click.argument("config_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--out",
    "out_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Write report.json, report.md and PNG figures here.",
)
@click.option(
    "--epsilon",
    type=float,
    default=None,
    callback=_finite_number,
    help="Change threshold |θ_t − θ₀| > epsilon (default: the config's, or 1e-5).",
)
@click.option(
    "--r",
    "r_values",
    default=None,
    metavar="R[,R...]",
    help="Tabulate λ per task for these r values, e.g. 0,0.05,0.1,0.2.",
)
@add_merge_options
def analyze(
    merge_options: MergeOptions,
    config_file: str,
    out_dir: str | None,
    epsilon: float | None,
    r_values: str | None,
) -> None:
    from mergekit_ram.analysis.report import build_report
    from mergekit_ram.commands.analysis import analyze_config

    sweep = None
    if r_values is not None:
        try:
            sweep = parse_r_values(r_values)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--r") from error
    install()
    merge_options.apply_global_options()
    config, _source, document = _load(config_file, "analyze")
    _refuse_report_folder(config, out_dir)
    findings = check_config(config, merge_options, document, "mergekit-ram analyze")
    try:
        analysis = analyze_config(
            config, merge_options, epsilon=epsilon, findings=findings
        )
    except RAMInputError:
        raise
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    _emit(build_report(analysis, sweep), out_dir)
    if out_dir is None:
        click.echo("Add --out DIR for report.json, report.md and the figures.")


def parse_r_values(text: str) -> list[float]:
    """'0,0.05,0.1' → [0.0, 0.05, 0.1]; every value finite and ≥ 0."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(
                f"an empty value in {text!r}: separate r values by one comma"
            )
        value = float(part)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"r must be a finite number ≥ 0, got {part!r}")
        values.append(value)
    if not values:
        raise ValueError("no r value given")
    return values
