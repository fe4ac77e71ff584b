"""The `nag-lightning` command: a table from command to the function that runs it.

`fit`, `validate`, `test` and `predict` are LightningCLI's (`nag_lightning.training.lightning_cli`),
with the model and data module of this package and its callbacks and loggers preset. The other
commands work around training, each a function in the layer it belongs to (`prepare` in data,
`export` in checkpoints, `compare`, `sweep`, `generate`, `depth-map`, `eval` and the studies in
analysis), named by "module:function" and imported only when it runs. Every command is one entry of
the table `COMMANDS`, and `dispatch` runs the one a command line names.

Bad input ends the command with one sentence on stderr and exit status 1; set
NAG_LIGHTNING_TRACEBACK=1 to see the whole traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from nag_lightning.arguments import flags_named, function_parser, summary

__all__ = ["COMMANDS", "Command", "dispatch", "flags_named", "function_parser", "main", "run_lightning_cli"]


def run_lightning_cli(args: list[str] | None = None, run: bool = True):
    """LightningCLI's commands (`nag_lightning.training.lightning_cli.run_lightning_cli`), then the
    figures of a finished `fit` drawn from the data its callbacks wrote (`draw_run_figures`)."""
    from nag_lightning.training.lightning_cli import run_lightning_cli as lightning_cli

    cli = lightning_cli(args, run=run)
    if run and cli.subcommand == "fit":
        from nag_lightning.analysis.reports.depth import draw_run_figures

        draw_run_figures(cli.trainer)
    return cli


LIGHTNING_CLI = "LightningCLI"
"""The `run` of LightningCLI's commands: `run_lightning_cli` takes the whole command line."""


@dataclass(frozen=True)
class Command:
    """One command of `nag-lightning`.

    Attributes:
        run: "module:function", called with the arguments after the command's name and imported
            only when the command runs, so `fit` does not pay for plotting or analysis imports; a
            table of subcommands (`nag-lightning study depth ...`), each a "module:function" whose
            typed arguments are its options; or LIGHTNING_CLI.
        summary: its line in the top-level help, which must not import the command to describe it.
    """

    run: str | dict[str, str]
    summary: str


COMMANDS: dict[str, Command] = {
    "fit": Command(LIGHTNING_CLI, "train a model (e.g. --config recipes/quickstart.yaml)"),
    "validate": Command(LIGHTNING_CLI, "evaluate a model or checkpoint on the validation data"),
    "test": Command(LIGHTNING_CLI, "evaluate a model or checkpoint on the test data"),
    "predict": Command(LIGHTNING_CLI, "bits per byte of every sequence of the data"),
    "prepare": Command("nag_lightning.data.prepare:prepare_command",
                       "tokenize a corpus into litdata chunks ahead of training"),
    "compare": Command("nag_lightning.analysis.reports.compare:compare_command",
                       "finished runs side by side: tokens, training FLOPs, final bits per byte"),
    "sweep": Command("nag_lightning.analysis.sweeps.sweep:sweep_command",
                     "accuracy against executed compute of a checkpoint's routing, CSV and PNG"),
    "generate": Command("nag_lightning.analysis.evaluation.generate:generate_command",
                        "continue a prompt from a checkpoint, routing causally"),
    "depth-map": Command("nag_lightning.analysis.reports.depth_map:depth_map_command",
                         "a text's tokens against the sublayers, coloured by angle, skips marked (PNG)"),
    "export": Command("nag_lightning.checkpoints.export:export_command",
                      "a checkpoint's model as safetensors, config.json and tokenizer.json"),
    "eval": Command("nag_lightning.analysis.evaluation.lm_eval_command:eval_command",
                    "lm-evaluation-harness tasks on a checkpoint (pip install 'nag-lightning[eval]')"),
    "study": Command({
        "depth": "nag_lightning.analysis.studies.depth:depth_study",
        "isoflop": "nag_lightning.analysis.studies.isoflop:isoflop_study",
        "tradeoff": "nag_lightning.analysis.studies.tradeoff:tradeoff_study",
        "tasks": "nag_lightning.analysis.studies.tasks:tasks_study",
        "tradeoff_tasks": "nag_lightning.analysis.studies.tradeoff_tasks:tradeoff_tasks_study",
        "gap": "nag_lightning.analysis.reports.depth_gap:depth_gap",
    }, "experiments of many runs: depth, isoflop, tradeoff, tasks, tradeoff_tasks; gap reads tasks runs"),
}


def top_level_help() -> str:
    """The help of `nag-lightning` itself, written without importing Lightning (seconds) or torch."""
    def lines(lightning: bool):
        return "\n".join(f"  {name:<10} {command.summary}" for name, command in COMMANDS.items()
                         if (command.run == LIGHTNING_CLI) == lightning)

    return (
        "usage: nag-lightning COMMAND [options]   (every command takes --help)\n\n"
        "Train and study Transformers with a norm-agnostic residual stream (NAG) and\n"
        "Mixture-of-Depths routing.\n\n"
        "Training, LightningCLI's commands (--config FILE, --print_config, every model, data and\n"
        "trainer option):\n" + lines(True) + "\n\n"
        "Around training:\n" + lines(False) + "\n"
    )


def _load(target: str) -> Callable:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_subcommand(command: str, args: list[str]) -> None:
    """`nag-lightning COMMAND NAME [options]` for a command with a table of subcommands."""
    table = COMMANDS[command].run
    if args and args[0] in ("-h", "--help"):
        print(f"usage: nag-lightning {command} {{{','.join(table)}}} [options]   (each takes --help)\n")
        width = max(10, *map(len, table))
        for name, target in table.items():
            print(f"  {name:<{width}} {summary(_load(target)).splitlines()[0]}")
        return
    if not args or args[0] not in table:
        raise ValueError(
            f"Name the {command} to run, one of {', '.join(table)}: e.g. "
            f"`nag-lightning {command} {next(iter(table))} --help`."
        )
    function = _load(table[args[0]])
    options = function_parser(function, f"nag-lightning {command} {args[0]}").parse_args(args[1:])
    function(**options.as_dict())


def dispatch(argv: list[str], from_shell: bool) -> None:
    """Run the command `argv` names (its entry in `COMMANDS`); anything else is LightningCLI's (its
    own options may come before the command: `--config FILE fit`)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(top_level_help(), end="")
        if not argv:
            raise ValueError("Name a command, e.g. `nag-lightning fit --config recipes/debug.yaml`.")
        return
    command = COMMANDS.get(argv[0])
    if command is None or command.run == LIGHTNING_CLI:
        run_lightning_cli(None if from_shell else argv)
    elif isinstance(command.run, dict):
        run_subcommand(argv[0], argv[1:])
    else:
        _load(command.run)(argv[1:])


def main(argv: list[str] | None = None) -> None:
    from_shell = argv is None
    try:
        dispatch(sys.argv[1:] if from_shell else argv, from_shell)
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        if os.environ.get("NAG_LIGHTNING_TRACEBACK"):
            raise
        from nag_lightning.inputs import shorten_message

        print(f"nag-lightning: error: {shorten_message(str(error))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
