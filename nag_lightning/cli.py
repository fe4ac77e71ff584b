"""The `nag-lightning` command.

`fit`, `validate`, `test` and `predict` are LightningCLI's, with the model and data module of this
package and its callbacks and loggers preset. The other commands (`prepare`, and those added by the
analysis modules) work around training and live in `COMMANDS`.

Bad input ends the command with one sentence on stderr and exit status 1; set
NAG_LIGHTNING_TRACEBACK=1 to see the whole traceback instead.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningArgumentParser

CHECKPOINT_ALIASES = ("last", "best", "hpc", "registry")


class NagCLI:
    """LightningCLI with this package's model, data, callbacks and loggers.

    Written as a mixin and combined with LightningCLI only when a LightningCLI command runs
    (`lightning_cli_class`): importing Lightning takes seconds, and the help and the commands that
    do not train should not pay for it.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        from nag_lightning.callbacks import DepthDiagnostics

        parser.link_arguments("model.seq_len", "data.seq_len")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.monitor": "val/bpb",
                             "checkpoint.filename": "step{step}-bpb{val/bpb:.4f}",
                             "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(DepthDiagnostics, "depth")

    def _parse_ckpt_path(self) -> None:
        """Refuse a missing checkpoint, and, for `fit`, one of another architecture, before
        LightningCLI would quietly replace the configured model with the checkpoint's."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and ckpt_path not in CHECKPOINT_ALIASES and "://" not in str(ckpt_path):
            if not Path(ckpt_path).is_file():
                raise FileNotFoundError(
                    f"The checkpoint {ckpt_path} does not exist; give the path of a .ckpt file "
                    "written by an earlier run (e.g. <run dir>/checkpoints/last.ckpt)."
                )
            if subcommand == "fit":
                check_architecture(ckpt_path, dict(self.config.fit.model))
        super()._parse_ckpt_path()


def check_architecture(ckpt_path: str, model_config: dict) -> None:
    """Raise one sentence if the checkpoint's architecture differs from `model_config`."""
    import torch

    from nag_lightning.module import architecture_differences

    saved = torch.load(ckpt_path, map_location="cpu", weights_only=True).get("hyper_parameters", {})
    differences = architecture_differences(saved, model_config)
    if differences:
        raise ValueError(
            f"The checkpoint {ckpt_path} was trained with a different architecture: "
            + ", ".join(differences)
            + "; resume with the same model settings (e.g. the run's config.yaml) or start a new "
            "run without ckpt_path."
        )


_LIGHTNING_CLI: type | None = None


def lightning_cli_class() -> type:
    """`NagCLI` on top of LightningCLI (built once; the import of Lightning happens here)."""
    global _LIGHTNING_CLI
    if _LIGHTNING_CLI is None:
        from lightning.pytorch.cli import LightningCLI

        _LIGHTNING_CLI = type("NagCLI", (NagCLI, LightningCLI), {"__doc__": NagCLI.__doc__})
    return _LIGHTNING_CLI


def run_lightning_cli(args: list[str] | None = None, run: bool = True) -> NagCLI:
    """The LightningCLI part of the command, also used by tests to parse recipes."""
    from nag_lightning.data import ByteDataModule
    from nag_lightning.module import NAGLanguageModel
    from nag_lightning.quiet import silence_irrelevant_messages

    silence_irrelevant_messages()
    return lightning_cli_class()(
        NAGLanguageModel,
        ByteDataModule,
        args=args,
        run=run,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={
            "default_root_dir": "runs",
            "logger": [
                {"class_path": "lightning.pytorch.loggers.CSVLogger",
                 "init_args": {"save_dir": "runs", "name": "default"}},
                {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                 "init_args": {"save_dir": "runs", "name": "default"}},
            ],
        },
    )


@contextmanager
def flags_named(names: Iterable[str], section: str = "data"):
    """Re-word an error that names a setting `section.X` (as `fit` spells it) to name the running
    command's own flag `--X`, for each X in `names`: the sentence must name what the user typed."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        pattern = rf"\b{re.escape(section)}\.({'|'.join(map(re.escape, names))})\b"
        text = re.sub(pattern, r"--\1", str(error))
        if text == str(error):
            raise
        raise type(error)(text) from None


def prepare_command(args: list[str]) -> None:
    """`nag-lightning prepare`: tokenize a corpus into litdata chunks ahead of training."""
    import inspect

    from jsonargparse import ArgumentParser

    from nag_lightning.data import prepare_corpus

    parser = ArgumentParser(prog="nag-lightning prepare", description=prepare_command.__doc__)
    parser.add_function_arguments(prepare_corpus)
    cfg = parser.parse_args(args)
    with flags_named(inspect.signature(prepare_corpus).parameters):
        path = prepare_corpus(**cfg.as_dict())
    print(f"prepared {path}")


# Commands around training: name -> "module:function" taking the remaining arguments, imported only
# when used so `fit` does not pay for plotting or analysis imports.
COMMANDS: dict[str, str] = {
    "prepare": "nag_lightning.cli:prepare_command",
    "compare": "nag_lightning.analysis.compare:compare_command",
    "sweep": "nag_lightning.analysis.sweep:sweep_command",
    "generate": "nag_lightning.analysis.generate:generate_command",
    "study": "nag_lightning.analysis.study:study_command",
}


# One line each for the top-level help, which must not import the commands to describe them.
SUMMARIES: dict[str, str] = {
    "fit": "train a model (e.g. --config recipes/quickstart.yaml)",
    "validate": "evaluate a model or checkpoint on the validation data",
    "test": "evaluate a model or checkpoint on the test data",
    "predict": "bits per byte of every sequence of the data",
    "prepare": "tokenize a corpus into litdata chunks ahead of training",
    "compare": "finished runs side by side: tokens, training FLOPs, final bits per byte",
    "sweep": "accuracy against executed compute of a checkpoint's routing, CSV and PNG",
    "generate": "continue a prompt from a checkpoint, routing causally",
    "study": "experiments of many runs: depth, isoflop, tradeoff",
}


def top_level_help() -> str:
    """The help of `nag-lightning` itself, written without importing Lightning (seconds) or torch."""
    def lines(names):
        return "\n".join(f"  {name:<10} {SUMMARIES.get(name, '')}" for name in names)

    return (
        "usage: nag-lightning COMMAND [options]   (every command takes --help)\n\n"
        "Train and study Transformers with a norm-agnostic residual stream (NAG) and\n"
        "Mixture-of-Depths routing.\n\n"
        "Training, LightningCLI's commands (--config FILE, --print_config, every model, data and\n"
        "trainer option):\n" + lines(("fit", "validate", "test", "predict")) + "\n\n"
        "Around training:\n" + lines(COMMANDS) + "\n"
    )


def _load_command(name: str) -> Callable[[list[str]], None]:
    module, _, function = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> None:
    from_shell = argv is None
    argv = sys.argv[1:] if from_shell else argv
    try:
        if argv and argv[0] in COMMANDS:
            _load_command(argv[0])(argv[1:])
        elif not argv or argv[0] in ("-h", "--help"):
            print(top_level_help(), end="")
            if not argv:
                raise ValueError("Name a command, e.g. `nag-lightning fit --config recipes/debug.yaml`.")
        else:
            run_lightning_cli(None if from_shell else argv)
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        if os.environ.get("NAG_LIGHTNING_TRACEBACK"):
            raise
        print(f"nag-lightning: error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
