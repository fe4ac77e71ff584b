"""LightningCLI's commands of `nag-lightning`: `fit`, `validate`, `test` and `predict`, with the
model and data module of this package and its callbacks and loggers preset (`NagCLI`), the run's
folder claimed and resumed (`nag_lightning.training.runs`), and `ckpt_path` read once through the
one checkpoint reader. `nag_lightning.cli` runs it for those commands (`run_lightning_cli`).
"""

from __future__ import annotations

import copy
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningArgumentParser

    from nag_lightning.checkpoints.reader import SavedCheckpoint
    from nag_lightning.training.runs import RunFolder

CHECKPOINT_ALIASES = ("last", "best", "hpc", "registry")
VOCAB_OPTION = "--model.arch.vocab_size"


class NagCLI:
    """LightningCLI with this package's model, data, callbacks and loggers.

    Written as a mixin and combined with LightningCLI only when a LightningCLI command runs
    (`lightning_cli_class`): importing Lightning takes seconds, and the help and the commands that
    do not train should not pay for it.
    """

    run_folder: RunFolder | None = None
    saved_checkpoint: SavedCheckpoint | None = None  # ckpt_path, read once (`read_ckpt_path`)

    def __init__(self, *args, **kwargs) -> None:
        """LightningCLI's, with the run's folder unlocked when the command ends, and removed again
        when the command fails before it wrote anything worth keeping there (bad input)."""
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            if self.run_folder is not None:
                trainer = getattr(self, "trainer", None)
                self.run_folder.release(trained=getattr(trainer, "global_step", 0) > 0)
            raise
        finally:
            if self.run_folder is not None:
                self.run_folder.unlock()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        from jsonargparse import lazy_instance

        from nag_lightning.callbacks import DepthDiagnostics, RunCheckpoint
        from nag_lightning.checkpoints.trust import TRUST_HELP
        from nag_lightning.data import TextDataModule

        # Any data module by class_path (task data: nag_lightning.tasks.datamodule.TaskDataModule), the text
        # one by default, so `data: {source: ...}` and `--data.source` need no class_path.
        parser.set_defaults({"data": lazy_instance(TextDataModule)})
        parser.link_arguments("model.arch.seq_len", "data.init_args.seq_len")
        # The vocabulary follows the tokenizer, known once the data module exists (a BPE is
        # trained then), so the link applies at instantiation.
        parser.link_arguments("data.vocab_size", "model.arch.vocab_size", apply_on="instantiate")
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.monitor": "val/bpb",
                             "checkpoint.filename": "step{step}-bpb{val/bpb:.4f}",
                             "checkpoint.auto_insert_metric_name": False})
        parser.add_lightning_class_args(DepthDiagnostics, "depth")
        parser.add_argument("--trust_checkpoint", type=bool, default=False, help=TRUST_HELP)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Parse, then settle the run's folder: resolve `--ckpt_path last` and claim one version
        for all loggers (see `nag_lightning.training.runs`)."""
        from nag_lightning.checkpoints.reader import damaged_last
        from nag_lightning.checkpoints.trust import UnreadableCheckpoint
        from nag_lightning.training.runs import prepare_run_folder

        self._parse_setting_vocab_aside(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        check_seed_everything(config.get("seed_everything"))
        asked = config.get("ckpt_path") if subcommand else None
        try:
            self.run_folder = prepare_run_folder(config, subcommand,
                                                 lambda path: self.read_ckpt_path(path).global_step)
            ckpt_path = config.get("ckpt_path") if subcommand else None
            if ckpt_path and ckpt_path not in CHECKPOINT_ALIASES:
                self.read_ckpt_path(ckpt_path)
        except UnreadableCheckpoint:
            if self.run_folder is not None:
                self.run_folder.release()
            if asked != "last":
                raise
            raise damaged_last(config.ckpt_path) from None
        except BaseException:
            if self.run_folder is not None:
                self.run_folder.release()
            raise

    def read_ckpt_path(self, path: str) -> SavedCheckpoint:
        """The checkpoint `path` names, read once for the whole command (`nag_lightning.checkpoints.reader`):
        the run folder takes its step, the parser its settings, the Trainer its state."""
        from nag_lightning.checkpoints.reader import read_saved

        if self.saved_checkpoint is None or self.saved_checkpoint.source != str(path):
            self.saved_checkpoint = read_saved(path)
        return self.saved_checkpoint

    def _parse_setting_vocab_aside(self, parser: LightningArgumentParser, args) -> None:
        """LightningCLI's parsing, with a `--model.arch.vocab_size` on the command line set aside
        (the link from data.tokenizer owns that setting) to be checked against the tokenizer; a
        config in the layout before `model.arch` is refused with one sentence saying how to map it."""
        from jsonargparse import Namespace

        self._typed_vocab_size = None
        if isinstance(args, (dict, Namespace)):
            return super().parse_arguments(parser, args)
        from nag_lightning.checkpoints.compat import refuse_older_layout

        refuse_older_layout(list(sys.argv[1:] if args is None else args))
        argv, typed = _without_option(list(sys.argv[1:] if args is None else args), VOCAB_OPTION)
        if typed is None:
            return super().parse_arguments(parser, args)
        try:
            self._typed_vocab_size = int(typed)
        except ValueError:
            raise ValueError(
                f"model.arch.vocab_size={typed!r} is not a number of token ids; leave it out: it follows "
                "data.tokenizer."
            ) from None
        self.config = parser.parse_args(argv)

    def instantiate_classes(self) -> None:
        """LightningCLI's, then one sentence if a vocabulary size given in a config or on the
        command line differs from the tokenizer's (the link would silently replace it)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        typed = self._typed_vocab_size
        if typed is None:
            # from a config file: the link replaces it
            typed = (config.model.get("arch") or {}).get("vocab_size")
        try:
            super().instantiate_classes()
        except BaseException as error:
            own = _own_sentence(error)
            if own is error:
                raise
            raise own from None
        if self.run_folder is not None:
            self.run_folder.attach(self.trainer)
        # the Trainer restores the dict read and checked here; any other file through the one reader
        strategy = self.trainer.strategy
        strategy.checkpoint_io = preloaded_checkpoint_io(strategy.checkpoint_io, self.saved_checkpoint)
        needed = getattr(self.datamodule, "vocab_size", None)
        if typed is not None and needed is not None and typed != needed:
            raise ValueError(
                f"model.arch.vocab_size={typed} does not match the {needed} token ids of "
                f"data.tokenizer={self.datamodule.tokenizer.spec!r}; leave model.arch.vocab_size out: it "
                "follows data.tokenizer."
            )

    def _instantiate_trainer(self, config, callbacks):
        """LightningCLI's, with the Trainer's refusals of its own settings (devices this
        accelerator cannot use, an accelerator whose library is missing) as one sentence."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            return super()._instantiate_trainer(config, callbacks)
        except (MisconfigurationException, TypeError, ImportError) as error:
            raise ValueError(f"The trainer settings cannot run here: {error}") from None

    def before_instantiate_classes(self) -> None:
        """Refuse trainer settings the Trainer would fail on with a traceback, or take silently:
        a step or epoch limit that would train nothing (Lightning keeps -1 for no limit), a
        negative clipping threshold, no devices, a GPU the machine does not have."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_devices(config.trainer)
        if self.subcommand == "fit":
            trainer = config.trainer
            limits = (("max_steps", "steps", "max_epochs"), ("max_epochs", "epochs", "max_steps"))
            for name, unit, other in limits:
                limit = trainer.get(name)
                if limit is not None and (limit == 0 or limit < -1):
                    problem = "would train nothing" if limit == 0 else f"is not a number of {unit}"
                    raise ValueError(
                        f"trainer.{name}={limit} {problem}; give a positive number of "
                        f"{'optimizer ' if unit == 'steps' else ''}{unit}, or -1 for no {unit[:-1]} "
                        f"limit (training then stops at trainer.{other})."
                    )
            clip = trainer.get("gradient_clip_val")
            if clip is not None and not clip >= 0:
                raise ValueError(
                    f"trainer.gradient_clip_val={clip} is not a gradient norm to clip at; give a "
                    "positive one (e.g. 1.0), or 0 or null not to clip."
                )

    def _parse_ckpt_path(self) -> None:
        """Read the checkpoint as untrusted input (`nag_lightning.checkpoints.trust`) and refuse it in one
        sentence if it is missing or unreadable, names code outside the registries, or, for `fit`,
        has another architecture; then take its model settings, as LightningCLI does, saying
        which of this run's settings they replace."""
        from nag_lightning.checkpoints.reader import refuse_full_unpickle
        from nag_lightning.checkpoints.settings import check_architecture

        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        refuse_full_unpickle(config.get("weights_only"), "drop --weights_only false")
        if "weights_only" in config:
            config["weights_only"] = True  # Lightning would unpickle a URL in full without it
        ckpt_path = config.get("ckpt_path")
        if not ckpt_path or ckpt_path in CHECKPOINT_ALIASES:
            return
        checkpoint = self.read_ckpt_path(ckpt_path)
        if subcommand == "fit" and checkpoint.exported:
            raise ValueError(
                f"{ckpt_path} is a folder of `nag-lightning export`, which holds weights but no "
                f"training state to resume; start a new run from its weights with "
                f"--model.init_weights {ckpt_path} instead of --ckpt_path."
            )
        model_config = config.model.as_dict()
        checkpoint.check_plugins(config.get("trust_checkpoint"), model_config)
        checkpoint.check_weights()  # sizes, shapes and saved settings, before data or model is built
        saved = copy.deepcopy(checkpoint.settings)
        if subcommand == "fit":
            check_architecture(saved, model_config.get("arch") or {}, ckpt_path)
        saved.pop("_instantiator", None)
        saved.pop("_class_path", None)  # the model class is fixed: LanguageModel
        # set by the link from data.tokenizer; the model checks the checkpoint's tokenizer on load
        saved.get("arch", {}).pop("vocab_size", None)
        replaced = replaced_settings(saved, model_config)
        if replaced:
            advice = ("; to train with other settings, start a new run without ckpt_path"
                      if subcommand == "fit" else "")
            _say(f"nag-lightning: {ckpt_path} brings its own model settings, which win over this "
                 f"run's: {', '.join(replaced)}{advice}.")
        if saved:
            self.config = self.parser.parse_object({subcommand: {"model": saved}}, self.config)


def _own_sentence(error: BaseException) -> BaseException:
    """The data module's own error, not the union of class choices jsonargparse wraps it in (the
    data is any LightningDataModule by class_path, so a bad `data.X` fails inside that union)."""
    cause = error.__cause__
    if str(error).startswith("Does not validate against any of the Union subtypes") and isinstance(
        cause, (ValueError, FileNotFoundError)
    ):
        return cause
    return error


def check_devices(trainer) -> None:
    """One sentence for `trainer.devices` naming no device, or `trainer.accelerator` naming a GPU
    this machine does not have (Lightning's own errors come as tracebacks)."""
    import torch

    devices, accelerator = trainer.get("devices"), trainer.get("accelerator")
    if devices in (0, "0", []) or (isinstance(devices, int) and devices < -1):
        raise ValueError(
            f"trainer.devices={devices!r} names no device; give a number of devices (e.g. 1), a "
            "list of device indices (e.g. [0, 1]), or -1 or 'auto' for all of them."
        )
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available() and not (
            accelerator == "gpu" and torch.backends.mps.is_available()):
        raise ValueError(
            f"trainer.accelerator={accelerator} needs a GPU, and torch finds none on this machine; "
            "use --trainer.accelerator cpu, or auto to take a GPU where there is one."
        )
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            "trainer.accelerator=mps needs Apple's Metal (MPS), which this machine does not offer; "
            "use --trainer.accelerator cpu."
        )


def check_seed_everything(seed: object) -> None:
    """One sentence for a seed numpy cannot take, naming the option (Lightning's names neither)."""
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**32:
        raise ValueError(
            f"seed_everything={seed} is outside the seeds numpy takes, 0 to {2**32 - 1}; give one "
            "in that range, or true for a random one."
        )


def preloaded_checkpoint_io(inner, saved: SavedCheckpoint | None):
    """`inner`, a strategy's CheckpointIO, except that loading `saved` (the checkpoint the command
    already read and checked) returns that dict instead of reading the file again, and loading any
    other checkpoint goes through the one reader (`nag_lightning.checkpoints.reader.read_saved`). Lightning
    2.x resumes and evaluates `ckpt_path` through `strategy.load_checkpoint`, which asks the
    CheckpointIO; a strategy that reads sharded checkpoints by itself does not ask it."""
    from lightning.pytorch.plugins.io import CheckpointIO

    from nag_lightning.checkpoints.reader import read_saved

    class PreloadedCheckpointIO(CheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

        def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
            nonlocal saved
            if saved is not None and os.path.abspath(str(path)) == os.path.abspath(saved.source):
                raw, saved = saved.raw, None  # handed over once: a later load reads afresh
                return raw
            return read_saved(path).raw

        def remove_checkpoint(self, path) -> None:
            inner.remove_checkpoint(path)

        def teardown(self) -> None:
            inner.teardown()

    return PreloadedCheckpointIO()


def _without_option(argv: list[str], option: str) -> tuple[list[str], str | None]:
    """`argv` without `option` (as `option=value` or `option value`), and its last value."""
    kept, value, i = [], None, 0
    while i < len(argv):
        if argv[i].startswith(option + "="):
            value = argv[i].split("=", 1)[1]
        elif argv[i] == option and i + 1 < len(argv):
            value = argv[i + 1]
            i += 1
        else:
            kept.append(argv[i])
        i += 1
    return kept, value


def replaced_settings(saved: dict, model_config: dict, prefix: str = "model.") -> list[str]:
    """`name=saved (not current)` for every model setting the checkpoint saved a different value of
    (the architecture's settings one by one)."""
    replaced = []
    for name, value in saved.items():
        if name not in model_config:
            continue
        if isinstance(value, dict) and isinstance(model_config[name], dict) and name == "arch":
            replaced += replaced_settings(value, model_config[name], f"{prefix}{name}.")
        elif _plain(value) != _plain(model_config[name]):
            replaced.append(f"{prefix}{name}={value!r} (not {model_config[name]!r})")
    return replaced


def _plain(value: object) -> object:
    """YAML-loaded and Python values alike: tuples as lists, an empty options mapping as None."""
    if isinstance(value, tuple):
        return list(value)
    return None if value == {} else value


def _say(line: str) -> None:
    """Print on the first rank only (called within LightningCLI, so Lightning is loaded already)."""
    from lightning.pytorch.utilities import rank_zero_only

    rank_zero_only(print)(line, file=sys.stderr)


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
    import lightning as L

    from nag_lightning.training.module import LanguageModel
    from nag_lightning.training.quiet import silence_irrelevant_messages

    silence_irrelevant_messages()
    return lightning_cli_class()(
        LanguageModel,
        L.LightningDataModule,  # text (TextDataModule) by default, see add_arguments_to_parser
        subclass_mode_data=True,
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
