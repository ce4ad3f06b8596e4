"""Adds the tools to the ``tokenmill`` command: ``bench``, ``eval``, ``quantize`` and ``train``.

Every process that loads plugins imports this module, so it imports nothing itself: the commands' modules are
imported when the ``tokenmill`` command asks for them, and they import torch only when a command runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def tokenmill_register_commands(cli: click.Group) -> None:
    from tokenmill_plugins.commands.bench.cli import bench
    from tokenmill_plugins.commands.eval.cli import eval_group
    from tokenmill_plugins.commands.quantize.cli import quantize
    from tokenmill_plugins.commands.train.cli import train

    for command in (bench, eval_group, quantize, train):
        cli.add_command(command)
