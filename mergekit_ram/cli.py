"""`mergekit-ram`: merge (as mergekit-yaml, with global RAM+) and demo."""

from __future__ import annotations

import click
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """RAM and RAM+ (Reinforced Agent Merging) for mergekit."""


@main.command("merge", cls=PrettyPrintHelp)
@click.argument("config_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path")
@add_merge_options
def merge(merge_options: MergeOptions, config_file: str, out_path: str) -> None:
    """Merge as mergekit-yaml does, with whole-model RAM+ statistics."""
    from mergekit_ram.api import run_merge

    merge_options.apply_global_options()
    with open(config_file, encoding="utf-8") as handle:
        source = handle.read()
    config = MergeConfiguration.model_validate(yaml.safe_load(source))
    run_merge(config, out_path, options=merge_options, config_source=source)


@main.command("demo")
@click.option("--out", "out_dir", default=None, help="Keep the demo models here.")
def demo(out_dir: str | None) -> None:
    """Build three toy RL-like agents, merge them with RAM+ and explain it."""
    from mergekit_ram.demo import run_demo

    run_demo(out_dir)
