"""The `nag-lightning` command end to end: recipes, fit, exact resume, and bad input."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import run_command as run_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
DEBUG = str(ROOT / "recipes" / "debug.yaml")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One data cache for the whole session, so the debug corpus is tokenized once."""
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_recipe_parses(recipe, capsys):
    status, printed, err = run_cli(["fit", "--config", str(recipe), "--print_config"], capsys)
    assert status == 0, err
    assert "residual:" in printed and "max_steps:" in printed


def test_fit_debug_recipe_through_the_console_command(tmp_path, cache_dir):
    command = shutil.which("nag-lightning") or pytest.fail("the nag-lightning command is not installed")
    result = subprocess.run(
        [command, "fit", "--config", DEBUG, f"--data.cache_dir={cache_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr  # only what concerns the run: none of these
    for noise in ("litlogger", "LeafSpec", "`IterableDataset` has `__len__`", "MFU is not logged"):
        assert noise not in printed, printed[-3000:]
    run = tmp_path / "runs" / "debug" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "depth_diagnostics.png").stat().st_size > 10_000
    metrics = (run / "metrics.csv").read_text()
    assert "val/bpb" in metrics and "depth/angle_mean/0_attn" in metrics and "train/lr" in metrics


class StopAfter(L.Callback):
    """Simulates a crash: raises once `step` optimizer steps are done (after checkpoints)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def fit_args(tmp_path: Path, cache_dir: str, *extra: str) -> list[str]:
    return [
        "fit", "--config", DEBUG, f"--data.cache_dir={cache_dir}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=8", "--trainer.val_check_interval=4",
        "--checkpoint.every_n_train_steps=3", "--checkpoint.save_top_k=-1",
        "--checkpoint.monitor=null", f"--checkpoint.dirpath={tmp_path / 'ckpt'}",
        "--checkpoint.filename=step{step}", *extra,
    ]


def final_weights(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.state_dict().items() if torch.is_tensor(v)}


def test_resume_mid_epoch_gives_the_same_weights(tmp_path, cache_dir, monkeypatch):
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    straight = run_lightning_cli(fit_args(tmp_path / "a", cache_dir))
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_lightning_cli(
            fit_args(tmp_path / "b", cache_dir, "--trainer.callbacks+=tests.test_cli.StopAfter",
                     "--trainer.callbacks.step=5")
        )
    checkpoint = tmp_path / "b" / "ckpt" / "step3.ckpt"  # mid-epoch: the epoch is far longer
    assert checkpoint.is_file() and not (tmp_path / "b" / "ckpt" / "step6.ckpt").exists()
    resumed = run_lightning_cli(fit_args(tmp_path / "b", cache_dir, f"--ckpt_path={checkpoint}"))
    assert resumed.trainer.global_step == straight.trainer.global_step == 8
    a, b = final_weights(straight), final_weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    loss_a = straight.trainer.callback_metrics["train/loss"]
    loss_b = resumed.trainer.callback_metrics["train/loss"]
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model.arch.residual=no-such-strategy"],
         "Unknown residual strategy 'no-such-strategy'; registered: .*nag, .*prenorm"),
        (["--model.arch.d_model=33"], "must be divisible by model.arch.n_heads"),
        (["--model.arch.seq_len=1"], "seq_len must be at least 2"),
        (["--data.source=/no/such/corpus.txt"], "does not exist"),
        (["--ckpt_path=/no/such/run/last.ckpt"], "The checkpoint /no/such/run/last.ckpt does not exist"),
    ],
)
def test_bad_input_gets_one_sentence(extra, message, tmp_path, cache_dir, capsys, monkeypatch, no_plugins):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(["fit", "--config", DEBUG, f"--data.cache_dir={cache_dir}", *extra], capsys)
    assert status == 1
    lines = [line for line in err.strip().splitlines() if line.startswith("nag-lightning: error:")]
    assert len(lines) == 1, err[-2000:]
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"), [("", "empty"), ("short text", "shorter than one sequence|fewer")]
)
def test_bad_corpus_gets_one_sentence(text, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    status, _, err = run_cli(
        ["fit", "--config", DEBUG, f"--data.source={corpus}", f"--data.cache_dir={tmp_path}/c"], capsys
    )
    assert status == 1 and "Traceback" not in err
    assert re.search(message, err, flags=re.I), err[-2000:]


def test_resuming_another_architecture_is_refused(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", DEBUG, f"--data.cache_dir={cache_dir}", "--trainer.max_steps=2"]
    assert run_cli(args, capsys)[0] == 0
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    status, _, err = run_cli([*args, "--model.arch.d_model=64", f"--ckpt_path={checkpoint}"], capsys)
    assert status == 1
    assert "different architecture: model.arch.d_model=32 (this run: 64)" in err


class PoisonWeights(L.Callback):
    """Makes the loss NaN from step `step` on, as a diverging run would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.head.weight.fill_(float("nan"))


def test_nan_loss_stops_with_a_sentence_and_keeps_checkpoints(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(
        fit_args(tmp_path, cache_dir, "--trainer.callbacks+=tests.test_cli.PoisonWeights",
                 "--trainer.callbacks.step=4"),
        capsys,
    )
    assert status == 1 and "Traceback" not in err
    assert "The training loss became nan at step 4" in err
    kept = torch.load(tmp_path / "ckpt" / "step3.ckpt", weights_only=False)
    assert kept["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in kept["state_dict"].values()
               if torch.is_tensor(v) and v.is_floating_point())


def test_help_lists_the_extra_commands(capsys):
    status, out, _ = run_cli(["--help"], capsys)
    assert status == 0
    for command in ("fit", "validate", "test", "predict", "prepare", "compare", "sweep", "generate", "study"):
        assert f"\n  {command} " in out, command


def echo_command(args: list[str]) -> None:
    """A command for the table test: prints the arguments it was given."""
    print(f"echo got {args}")


def test_every_command_of_the_table_answers_help_and_a_new_entry_runs(capsys, monkeypatch):
    from nag_lightning import cli

    for name, command in cli.COMMANDS.items():
        if command.run != cli.LIGHTNING_CLI:  # LightningCLI's help: the training tests
            status, out, _ = run_cli([name, "--help"], capsys)
            assert status == 0 and f"nag-lightning {name}" in out, name
    echo = cli.Command("tests.test_cli:echo_command", "print its arguments")
    monkeypatch.setitem(cli.COMMANDS, "echo", echo)
    status, out, _ = run_cli(["echo", "a", "--b"], capsys)
    assert status == 0 and "echo got ['a', '--b']" in out
    assert "\n  echo       print its arguments\n" in run_cli(["--help"], capsys)[1]


def test_help_and_the_commands_that_do_not_train_import_no_lightning():
    """Importing Lightning takes seconds; `--help` and `generate`/`compare` do not need it."""
    script = (
        "import sys\n"
        "from nag_lightning.cli import main\n"
        "for args in (['--help'], ['generate', '--help'], ['compare', '--help'], ['study', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as exit_:\n"
        "        assert not exit_.code, (args, exit_.code)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_generate_reads_its_checkpoint_without_lightning(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["fit", "--config", DEBUG, f"--data.cache_dir={cache_dir}", "--trainer.max_steps=2",
                    "--trainer.enable_progress_bar=false"], capsys)[0] == 0
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    script = (
        "import sys\n"
        "from nag_lightning.cli import main\n"
        f"main(['generate', '--ckpt_path', {str(checkpoint)!r}, '--max_new_tokens', '4'])\n"
        "print('lightning' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    out = result.stdout.decode("utf-8", errors="replace")  # generate writes bytes, as generated
    assert result.returncode == 0, result.stderr.decode("utf-8", errors="replace")[-3000:]
    assert "sublayers executed per generated byte" in out
    assert out.strip().splitlines()[-1] == "False"
    # what the checkpoint names is looked up in the registries only: a class path is refused unless trusted
    saved = torch.load(checkpoint, weights_only=True)
    saved["hyper_parameters"]["residual"] = {"class_path": "os.system"}
    torch.save(saved, tmp_path / "doctored.ckpt")
    status, _, err = run_cli(["generate", "--ckpt_path", str(tmp_path / "doctored.ckpt")], capsys)
    assert status == 1 and "no registry knows" in err and "--trust_checkpoint" in err
    assert "Traceback" not in err


def test_study_help_lists_the_studies_and_their_help_says_each_option_once(capsys):
    status, out, _ = run_cli(["study", "--help"], capsys)
    assert status == 0
    assert all(f"\n  {name} " in out for name in ("depth", "isoflop", "tradeoff"))
    status, out, _ = run_cli(["study", "depth", "--help"], capsys)
    assert status == 0
    assert "Args:" not in out and out.count("numbers of blocks to train") == 1


def test_prepare_names_its_own_flags(tmp_path, capsys):
    status, _, err = run_cli(["prepare", "--source", str(tmp_path / "nonexistent"),
                              "--cache_dir", str(tmp_path / "c")], capsys)
    assert status == 1
    assert "in --source." in err and "data.source" not in err
    status, _, err = run_cli(["prepare", "--max_bytes", "0", "--cache_dir", str(tmp_path / "c")], capsys)
    assert status == 1 and "--max_bytes must be positive" in err


def test_every_recipe_counts_training_flops():
    """`compare` shows the FLOPs of any run trained from a recipe (the accounting costs 0.3%)."""
    import yaml

    for recipe in RECIPES:
        callbacks = yaml.safe_load(recipe.read_text())["trainer"].get("callbacks") or []
        paths = [c["class_path"] if isinstance(c, dict) else c for c in callbacks]
        assert "nag_lightning.callbacks.FlopAccounting" in paths, recipe


@pytest.mark.slow
def test_quickstart_trains_as_the_readme_says(tmp_path):
    """The README's first command, to the end: 600 steps, 83-164 s on an idle 2-core machine."""
    import csv

    command = shutil.which("nag-lightning") or pytest.fail("the nag-lightning command is not installed")
    result = subprocess.run([command, "fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"),
                             "--trainer.enable_progress_bar=false"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart" / "version_0"
    with open(run / "metrics.csv") as f:
        bpb = [float(r["val/bpb"]) for r in csv.DictReader(f) if r.get("val/bpb")]
    assert len(bpb) == 6 and bpb == sorted(bpb, reverse=True), bpb  # README: 3.106 ... 2.146
    assert bpb[-1] < 2.3, bpb
    assert (run / "depth_diagnostics.png").is_file() and (run / "checkpoints" / "last.ckpt").is_file()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
