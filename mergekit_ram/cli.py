"""`mergekit-ram`: merge (as mergekit-yaml, with global RAM+), analyze and demo."""

from __future__ import annotations

import click
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """RAM and RAM+ (Reinforced Agent Merging) for mergekit."""


def _load(config_file: str) -> tuple[MergeConfiguration, str]:
    with open(config_file, encoding="utf-8") as handle:
        source = handle.read()
    return MergeConfiguration.model_validate(yaml.safe_load(source)), source


def _emit(report: dict, out_dir: str | None) -> None:
    from mergekit_ram.analyze import render_text, write_report

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
    from mergekit_ram.api import run_merge

    merge_options.apply_global_options()
    config, source = _load(config_file)
    if report_dir is None:
        run_merge(config, out_path, options=merge_options, config_source=source)
        return

    from mergekit_ram.analyze import build_report, merge_with_analysis

    analysis = merge_with_analysis(
        config, out_path, merge_options, source, echo=click.echo
    )
    _emit(build_report(analysis), report_dir)


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
    type=click.FloatRange(min=0),
    default=None,
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
    from mergekit_ram.analyze import analyze_config, build_report, parse_r_values

    sweep = None
    if r_values is not None:
        try:
            sweep = parse_r_values(r_values)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--r") from error
    merge_options.apply_global_options()
    config, _source = _load(config_file)
    try:
        analysis = analyze_config(config, merge_options, epsilon=epsilon)
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    _emit(build_report(analysis, sweep), out_dir)
    if out_dir is None:
        click.echo("Add --out DIR for report.json, report.md and the figures.")


@main.command("demo")
@click.option("--out", "out_dir", default=None, help="Keep the demo models here.")
def demo(out_dir: str | None) -> None:
    """Build three toy RL-like agents, merge them with RAM+ and explain it."""
    from mergekit_ram.demo import run_demo

    run_demo(out_dir)
