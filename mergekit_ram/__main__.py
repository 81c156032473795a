"""`python -m mergekit_ram`: the mergekit-ram command."""

from mergekit_ram.commands.cli import main

main(prog_name="python -m mergekit_ram")
