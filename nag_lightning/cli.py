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
import sys
from collections.abc import Callable

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from nag_lightning.callbacks import DepthDiagnostics, RunCheckpoint
from nag_lightning.data import ByteDataModule
from nag_lightning.module import NAGLanguageModel, architecture_differences
from nag_lightning.runs import RunFolder, prepare_run_folder
from nag_lightning.trust import TRUST_HELP, check_plugins, read_checkpoint

CHECKPOINT_ALIASES = ("last", "best", "hpc", "registry")


class NagCLI(LightningCLI):
    """LightningCLI with this package's model, data, callbacks and loggers."""

    run_folder: RunFolder | None = None

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse, then settle the run's folder: resolve `--ckpt_path last` and claim one version
        for all loggers (see `nag_lightning.runs`)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        self.run_folder = prepare_run_folder(self.config[subcommand] if subcommand else self.config,
                                             subcommand)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except BaseException:
            if self.run_folder is not None:
                self.run_folder.release()
            raise
        if self.run_folder is not None:
            self.run_folder.attach(self.trainer)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.seq_len", "data.seq_len")
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.monitor": "val/bpb",
                             "checkpoint.filename": "step{step}-bpb{val/bpb:.4f}",
                             "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(DepthDiagnostics, "depth")
        parser.add_argument("--trust_checkpoint", type=bool, default=False, help=TRUST_HELP)

    def before_instantiate_classes(self) -> None:
        """Refuse a step limit that would train nothing (Lightning keeps -1 for no limit)."""
        if self.subcommand == "fit":
            max_steps = self.config.fit.trainer.max_steps
            if max_steps is not None and (max_steps == 0 or max_steps < -1):
                problem = "would train nothing" if max_steps == 0 else "is not a number of steps"
                raise ValueError(
                    f"trainer.max_steps={max_steps} {problem}; give a positive number of optimizer "
                    "steps, or -1 for no step limit (training then stops at trainer.max_epochs)."
                )

    def _parse_ckpt_path(self) -> None:
        """Read the checkpoint as untrusted input (`nag_lightning.trust`) and refuse it in one
        sentence if it is missing or unreadable, names code outside the registries, or, for `fit`,
        has another architecture; then take its model settings, as LightningCLI does, saying
        which of this run's settings they replace."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        if config.get("weights_only") is False:
            raise ValueError(
                "Checkpoints load with weights_only=True only, because a checkpoint may come from "
                "anyone and a full unpickle can run its code; drop --weights_only false."
            )
        if "weights_only" in config:
            config["weights_only"] = True  # Lightning would unpickle a URL in full without it
        ckpt_path = config.get("ckpt_path")
        if not ckpt_path or ckpt_path in CHECKPOINT_ALIASES:
            return
        checkpoint = read_checkpoint(ckpt_path)
        model_config = config.model.as_dict()
        check_plugins(checkpoint, ckpt_path, config.get("trust_checkpoint"), model_config)
        saved = dict(checkpoint.get("hyper_parameters") or {})
        if subcommand == "fit":
            check_architecture(ckpt_path, model_config, saved)
        saved.pop("_instantiator", None)
        saved.pop("_class_path", None)  # the model class is fixed: NAGLanguageModel
        replaced = replaced_settings(saved, model_config)
        if replaced:
            advice = ("; to train with other settings, start a new run without ckpt_path"
                      if subcommand == "fit" else "")
            _say(f"nag-lightning: {ckpt_path} brings its own model settings, which win over this "
                 f"run's: {', '.join(replaced)}{advice}.")
        if saved:
            self.config = self.parser.parse_object({subcommand: {"model": saved}}, self.config)


def check_architecture(ckpt_path: str, model_config: dict, saved: dict | None = None) -> None:
    """Raise one sentence if the checkpoint's architecture differs from `model_config`."""
    if saved is None:
        saved = read_checkpoint(ckpt_path).get("hyper_parameters", {})
    differences = architecture_differences(saved, model_config)
    if differences:
        raise ValueError(
            f"The checkpoint {ckpt_path} was trained with a different architecture: "
            + ", ".join(differences)
            + "; resume with the same model settings (e.g. the run's config.yaml) or start a new "
            "run without ckpt_path."
        )


def replaced_settings(saved: dict, model_config: dict) -> list[str]:
    """`name=saved (not current)` for every model setting the checkpoint saved a different value of."""
    return [
        f"model.{name}={value!r} (not {model_config.get(name)!r})"
        for name, value in saved.items()
        if name in model_config and _plain(value) != _plain(model_config[name])
    ]


def _plain(value: object) -> object:
    """YAML-loaded and Python values alike: tuples as lists, an empty options mapping as None."""
    if isinstance(value, tuple):
        return list(value)
    return None if value == {} else value


@rank_zero_only
def _say(line: str) -> None:
    print(line, file=sys.stderr)


def run_lightning_cli(args: list[str] | None = None, run: bool = True) -> NagCLI:
    """The LightningCLI part of the command, also used by tests to parse recipes."""
    return NagCLI(
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


def prepare_command(args: list[str]) -> None:
    """`nag-lightning prepare`: tokenize a corpus into litdata chunks ahead of training."""
    from jsonargparse import ArgumentParser

    from nag_lightning.data import prepare_corpus

    parser = ArgumentParser(prog="nag-lightning prepare", description=prepare_command.__doc__)
    parser.add_function_arguments(prepare_corpus)
    cfg = parser.parse_args(args)
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


def _load_command(name: str) -> Callable[[list[str]], None]:
    module, _, function = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> None:
    from_shell = argv is None
    argv = sys.argv[1:] if from_shell else argv
    try:
        if argv and argv[0] in COMMANDS:
            _load_command(argv[0])(argv[1:])
        else:
            if not argv or argv[0] in ("-h", "--help"):
                print("Commands besides LightningCLI's: " + ", ".join(sorted(COMMANDS))
                      + " (each takes --help).\n")
            run_lightning_cli(None if from_shell else argv)
    except (ValueError, FileNotFoundError, FloatingPointError) as error:
        if os.environ.get("NAG_LIGHTNING_TRACEBACK"):
            raise
        print(f"nag-lightning: error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
