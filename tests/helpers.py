"""Helpers shared by the tests that run the command in-process."""

from __future__ import annotations

from nag_lightning.cli import main


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """Run `nag-lightning ARGS` in-process; return its exit status and stderr."""
    try:
        main(args)
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    return status, capsys.readouterr().err
