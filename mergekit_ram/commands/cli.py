"""`mergekit-ram`: merge (as mergekit-yaml, with global RAM+), analyze and demo."""

from __future__ import annotations

import json
import math
from typing import Any

import click
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options
from pydantic import ValidationError

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.errors import ClickInputError
from mergekit_ram.integration.install import install


class _Commands(click.Group):
    """Our commands, with a RAMInputError printed as `Error: ...` (exit 2)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ClickInputError:
            raise
        except RAMInputError as error:
            raise ClickInputError(str(error)) from error


def versions() -> str:
    """The installed mergekit-ram and mergekit versions: a bug report needs both."""
    from importlib.metadata import version

    return f"mergekit-ram {version('mergekit-ram')}, mergekit {version('mergekit')}"


def _show_versions(
    context: click.Context, _param: click.Parameter, value: bool
) -> None:
    if value and not context.resilient_parsing:
        click.echo(versions())
        context.exit()


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_versions,
    help="Show mergekit-ram's and mergekit's versions and exit.",
)
def main() -> None:
    """RAM and RAM+ (Reinforced Agent Merging) for mergekit."""
    install()


VALUE_LIMIT = 100_000  # YAML values after aliases are expanded; a config has hundreds
SHOWN_LIMIT = 200  # characters of an offending value echoed back
PROBLEM_LIMIT = 5  # schema problems listed, the rest counted


def _load(config_file: str) -> tuple[MergeConfiguration, str]:
    """The configuration and its text; bad YAML or schema is a RAMInputError."""
    with open(config_file, encoding="utf-8") as handle:
        source = handle.read()
    loader = yaml.SafeLoader(source)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > VALUE_LIMIT:
            raise RAMInputError(
                f"{config_file} uses YAML aliases (*name) that expand to more "
                f"than {VALUE_LIMIT} values, far more than any merge "
                "configuration needs (an alias bomb?). Write the configuration "
                "out without nesting aliases."
            )
        document = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as error:
        raise RAMInputError(_yaml_problem(config_file, error)) from error
    finally:
        loader.dispose()
    try:
        return MergeConfiguration.model_validate(document), source
    except ValidationError as error:
        problem = _schema_problems(error)
    except RuntimeError as error:  # mergekit's own validators raise these
        problem = str(error)
    raise RAMInputError(
        f"{config_file} is not a valid mergekit configuration: {problem}. "
        "example_configs/ holds working RAM and RAM+ configurations."
    )


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for once every alias is expanded.

    An alias is the same node object in several places: counting each node
    once (memoized by identity) costs what the text costs, while the
    expanded document can be exponentially larger.
    """
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = VALUE_LIMIT + 1  # a recursive alias expands forever
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(item, sizes) for item in node.value)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            size += _expanded_size(key, sizes) + _expanded_size(value, sizes)
    sizes[id(node)] = min(size, VALUE_LIMIT + 1)
    return sizes[id(node)]


def _yaml_problem(config_file: str, error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = (
        "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
    )
    problem = getattr(error, "problem", None) or str(error)
    return (
        f"{config_file} is not valid YAML{where}: {problem}. Fix the syntax there "
        "(indentation, a missing ':' or an unquoted special character)."
    )


def _schema_problems(error: ValidationError) -> str:
    """Each offending key once: pydantic reports every union alternative."""
    grouped: dict[Any, list[dict]] = {}
    for item in error.errors():
        key = (
            ("missing", item["loc"]) if item["type"] == "missing" else id(item["input"])
        )
        grouped.setdefault(key, []).append(item)
    problems = []
    for items in grouped.values():
        loc = _common_prefix([item["loc"] for item in items])
        if items[0]["type"] == "missing":
            text = " is required"
        elif len(items) == 1:
            text = f": {items[0]['msg']} (got {_shown(items[0]['input'])})"
        else:
            text = f": {_shown(items[0]['input'])} is not a valid value"
        problems.append(_dotted(loc) + text)
    more = len(problems) - PROBLEM_LIMIT
    shown = "; ".join(problems[:PROBLEM_LIMIT])
    return shown if more <= 0 else f"{shown}; and {more} more problem(s)"


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        size = next(
            (i for i, (a, b) in enumerate(zip(prefix, loc)) if a != b),
            min(len(prefix), len(loc)),
        )
        prefix = prefix[:size]
    return prefix


def _dotted(loc: tuple) -> str:
    """A pydantic location as the YAML path a user reads: models[0].model."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    return text.lstrip(".") or "the document"


def _shown(value: Any) -> str:
    """A value as JSON, cut short: what a user typed may be huge."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= SHOWN_LIMIT else f"{text[:SHOWN_LIMIT]}…"


def _finite_number(
    _context: click.Context, parameter: click.Parameter, value: float | None
) -> float | None:
    """A number option passes the checks its YAML key does (the method's type)."""
    from mergekit_ram.integration.methods import METHODS
    from mergekit_ram.integration.parameter_schema import number_problem

    spec = next(s for s in METHODS[0].spec.parameters if s.name == parameter.name)
    problem = None if value is None else number_problem(spec, value)
    if problem:
        raise click.BadParameter(f"{value!r} {problem}; it must be a finite number ≥ 0")
    return value


def _refuse_report_folder(config: Any, folder: str | None) -> None:
    """A report folder gets OUT's path checks before any weight is read: a
    folder that can be made, never one that adds files to an input."""
    if folder is not None:
        from mergekit_ram.integration.output_folder import resolve_output
        from mergekit_ram.integration.publishing import refuse_input_folder

        resolve_output(folder, "report folder")
        refuse_input_folder(config, folder, "report folder")


def _emit(report: dict, out_dir: str | None) -> None:
    from mergekit_ram.commands.render import render_text
    from mergekit_ram.commands.report_files import write_report

    click.echo(render_text(report), nl=False)
    if out_dir is not None:
        _paths, message = write_report(report, out_dir)
        click.echo(message)


@main.command("merge", cls=PrettyPrintHelp)
@click.argument("config_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path")
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
    """Merge as mergekit-yaml does, with whole-model RAM+ statistics."""
    from mergekit_ram.commands.api import run_merge

    merge_options.apply_global_options()
    config, source = _load(config_file)
    _refuse_report_folder(config, report_dir)
    if report_dir is None:
        run_merge(config, out_path, options=merge_options, config_source=source)
        return

    from mergekit_ram.commands.analysis import merge_with_analysis
    from mergekit_ram.commands.report import build_report

    analysis = merge_with_analysis(
        config, out_path, merge_options, source, echo=click.echo
    )
    _emit(build_report(analysis), report_dir)


# The MergeOptions fields analyze reads: where and how models are found and
# loaded (mergekit's planner and loader cache), where the statistics pass
# computes, and logging. The others shape a merge's execution or its output
# (shards, model card, tokenizer copy, seed, multi-GPU, writer threads).
ANALYZE_OPTIONS = frozenset(
    {
        "allow_crimes",
        "unsafe_truncate_embeddings",
        "transformers_cache",
        "lora_merge_cache",
        "lora_merge_dtype",
        "trust_remote_code",
        "lazy_unpickle",
        "cuda",
        "device",
        "low_cpu_memory",
        "read_to_gpu",
        "num_threads",
        "verbosity",
        "quiet",
    }
)


def _analyze_options_only(command: click.Command) -> click.Command:
    """`command` without the merge options analyze would ignore: an option it
    accepts is one it uses, and any other is a usage error."""
    ignored = set(MergeOptions.model_fields) - ANALYZE_OPTIONS
    command.params = [p for p in command.params if p.name not in ignored]
    return command


@_analyze_options_only
@main.command("analyze", cls=PrettyPrintHelp)
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
    """Show the task vectors' overlap statistics and RAM+ λ before merging.

    CONFIG_FILE is the YAML a merge would use (any merge_method; only the
    models and the base model matter).
    """
    from mergekit_ram.commands.analysis import analyze_config
    from mergekit_ram.commands.report import build_report
    from mergekit_ram.integration.validation import validate_analysis

    sweep = None
    if r_values is not None:
        try:
            sweep = parse_r_values(r_values)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--r") from error
    merge_options.apply_global_options()
    config, _source = _load(config_file)
    _refuse_report_folder(config, out_dir)
    validate_analysis(config, merge_options)
    try:
        analysis = analyze_config(config, merge_options, epsilon=epsilon)
    except RAMInputError:
        raise
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    _emit(build_report(analysis, sweep), out_dir)
    if out_dir is None:
        click.echo("Add --out DIR for report.json, report.md and the figures.")


@main.command("demo")
@click.option("--out", "out_dir", default=None, help="Keep the demo models here.")
def demo(out_dir: str | None) -> None:
    """Build three toy RL-like agents, merge them with RAM+ and explain it.

    Without --out everything goes to a temporary folder, removed at the end
    (also on error or Ctrl-C): a demo should not leave files behind.
    """
    import tempfile

    from mergekit_ram.commands.demo import run_demo

    if out_dir is not None:
        run_demo(out_dir)
        return
    with tempfile.TemporaryDirectory(prefix="mergekit-ram-demo-") as root:
        run_demo(root)
    click.echo(f"Removed {root} (use --out DIR to keep the models and the merge).")


def parse_r_values(text: str) -> list[float]:
    """'0,0.05,0.1' → [0.0, 0.05, 0.1]; every value finite and ≥ 0."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value = float(part)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"r must be a finite number ≥ 0, got {part!r}")
        values.append(value)
    if not values:
        raise ValueError("no r value given")
    return values
