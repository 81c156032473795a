"""`mergekit-ram`: merge, analyze and demo; --version and --help answer at once.

The group imports click and nothing heavy: `merge` and `analyze` take
mergekit's own options, whose module imports torch and transformers
(seconds), so they live in `merge_cli`, imported when one of them runs or
shows its help (as long as `mergekit-yaml --help` takes).
"""

from __future__ import annotations

import os
import tempfile
from importlib import import_module
from importlib.metadata import version
from importlib.util import find_spec
from typing import Any, NamedTuple

import click

from mergekit_ram.commands.install import install
from mergekit_ram.integration.errors import IncompatibleMergekit, click_errors


class Entry(NamedTuple):
    module: str  # where the command is defined
    help: str  # its description: the command's own help and the group's list


COMMANDS = {
    "merge": Entry(
        "mergekit_ram.commands.merge_cli",
        "Merge as mergekit-yaml does, with RAM+ statistics counted over the "
        "whole model. CONFIG_FILE is the merge's YAML (merge_method: ram or "
        "ramplus, or any other method, left to mergekit); OUT_PATH is the folder "
        "the merged model is written into (made if missing; the merge replaces "
        "only its own files there).",
    ),
    "analyze": Entry(
        "mergekit_ram.commands.merge_cli",
        "Show how the agents' task vectors overlap, RAM+'s λ and which case "
        "they are in, before merging. CONFIG_FILE is the YAML a merge would use "
        "(any merge_method; only the models and the base model matter).",
    ),
    "demo": Entry(
        __name__,
        "Build three toy RL-like agents, merge them with RAM+ and explain the "
        "result. Without --out everything goes to a temporary folder, removed at "
        "the end (also on error or Ctrl-C).",
    ),
}


class _Commands(click.Group):
    """Our commands, imported when used; a RAMInputError is printed as
    `Error: ...` (exit 2); the list shows each command's whole description."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        entry = COMMANDS.get(name)
        if entry is not None and entry.module != __name__:
            install()  # the host probed before a module that relies on it loads
        return None if entry is None else getattr(import_module(entry.module), name)

    def format_commands(self, ctx: click.Context, formatter: Any) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, entry.help) for name, entry in COMMANDS.items()])

    def invoke(self, ctx: click.Context) -> Any:
        with click_errors():
            return super().invoke(ctx)


def _version(ctx: click.Context, _param: Any, value: bool) -> None:
    """Both versions (a bug report needs both), where mergekit was found and
    whether the plugin is installed into it, or why not."""
    if not value or ctx.resilient_parsing:
        return
    state = "mergekit-ram is installed into it"
    try:
        install()
    except IncompatibleMergekit as error:
        state = f"NOT installed: {error.message}"
    where = os.path.dirname(find_spec("mergekit").origin)
    ours, host = version("mergekit-ram"), version("mergekit")
    click.echo(f"mergekit-ram {ours}, mergekit {host} ({where}): {state}")
    ctx.exit()


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_version,
    help="Show mergekit-ram's and mergekit's versions, and whether mergekit-ram "
    "is installed into that mergekit (or why not), and exit.",
)
def main() -> None:
    """RAM and RAM+ (Reinforced Agent Merging) for mergekit."""


@click.command("demo", help=COMMANDS["demo"].help)
@click.option(
    "--out",
    "out_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Keep the demo's models, config and merge in this folder.",
)
def demo(out_dir: str | None) -> None:
    install()  # before the demo's modules, which rely on the host
    from mergekit_ram.commands.demo import run_demo

    if out_dir is not None:
        run_demo(out_dir)
        return
    with tempfile.TemporaryDirectory(prefix="mergekit-ram-demo-") as root:
        run_demo(root)
    click.echo(f"Removed {root} (use --out DIR to keep the models and the merge).")
