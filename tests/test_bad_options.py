"""Bad options end the command with one sentence and exit status 1, never a traceback, and are not
taken silently: one test per class of option (data source, tokenizer, trainer limits and devices,
seeds, router rates, generate and sweep options, damaged run files, study lists)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import lightning.pytorch  # noqa: F401 - imported here, its log handlers keep the real stderr, not a test's capture
import pytest
import torch

from nag_lightning.analysis.sweeps.sweepable import sweep_of
from nag_lightning.cli import main
from nag_lightning.routers.topk import TopKRouter
from tests.helpers import DEBUG, fit_args, run_cli, run_command
from tests.test_bad_input import one_sentence

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory) -> Path:
    """A debug model trained for 3 steps."""
    root = tmp_path_factory.mktemp("bad_options_run")
    with contextlib.chdir(root):
        main(fit_args(corpus))
    return root / "runs" / "debug" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("source", ["", "[]", "[corpus.txt, '']", "['  ']"],
                         ids=["empty", "empty_list", "empty_item", "blank_item"])
def test_an_empty_data_source_is_refused(source, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(corpus.parent)  # where an empty path would read every file
    sentence = one_sentence(*run_cli(fit_args(corpus, f"--data.source={source}"), capsys))
    assert "names no text; give a file, folder, glob or URI" in sentence
    sentence = one_sentence(*run_cli(["prepare", f"--source={source}", f"--cache_dir={tmp_path}"], capsys))
    assert "--source=" in sentence and "names no text" in sentence
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model.arch.residual=../../x"], r"'../../x' is neither a registered residual strategy nor "
                                            r"the dotted path of a class \(package.module.Class\)"),
        (["--data.tokenizer=bpe:10000000"], r"data.tokenizer='bpe:10000000' asks for more token ids "
                                            r"than the largest BPE the data trains \(262,144\)"),
        (["--trainer.max_epochs=0"], r"trainer.max_epochs=0 would train nothing"),
        (["--trainer.max_epochs=-3"], r"trainer.max_epochs=-3 is not a number of epochs"),
        (["--trainer.gradient_clip_val=-1"], r"trainer.gradient_clip_val=-1(\.0)? is not a gradient norm"),
        (["--trainer.devices=0"], r"trainer.devices='0' names no device"),
        (["--trainer.devices=[]"], r"trainer.devices=\[\] names no device"),
        (["--seed_everything=100000000000000000000000"],
         r"seed_everything=100000000000000000000000 is outside the seeds numpy takes, 0 to 4294967295"),
        (["--trainer.accelerator=cpu", "--trainer.devices=[5]"],
         r"The trainer settings cannot run here: `devices` selected with `CPUAccelerator` should be"),
    ],
    ids=["residual_path", "bpe_too_large", "max_epochs_0", "max_epochs_negative", "clip_negative",
         "devices_0", "devices_empty", "seed", "misconfigured"],
)
def test_bad_trainer_and_data_settings(extra, message, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sentence = one_sentence(*run_cli(fit_args(corpus, *extra), capsys))
    assert re.search(message, sentence), sentence
    assert not (tmp_path / "runs").exists()


@NO_GPU
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_accelerator_without_a_gpu(accelerator, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sentence = one_sentence(*run_cli(fit_args(corpus, f"--trainer.accelerator={accelerator}"), capsys))
    assert f"trainer.accelerator={accelerator} needs a GPU, and torch finds none" in sentence


RATES = [  # (router, option, value, accepted): every rate, capacity or probability at 0, 1, > 1, < 0
    ("threshold", "target_rate", 0, True), ("threshold", "target_rate", 1, False),
    ("threshold", "target_rate", 1.5, False), ("threshold", "target_rate", -0.1, False),
    ("threshold", "tau_average", 0, False), ("threshold", "tau_average", 1, True),
    ("threshold", "tau_average", 1.5, False), ("threshold", "tau_average", -1, False),
    ("threshold", "calibration", 0, False), ("threshold", "calibration", 1, True),
    ("threshold", "calibration", 2, False), ("threshold", "calibration", -1, False),
    ("topk", "capacity", 0, False), ("topk", "capacity", 1, True),
    ("topk", "capacity", 1.5, False), ("topk", "capacity", -0.5, False),
]


@pytest.mark.parametrize(("router", "option", "value", "accepted"), RATES,
                         ids=[f"{r}-{o}-{v}" for r, o, v, _ in RATES])
def test_router_rates_train_or_are_refused(router, option, value, accepted, corpus, tmp_path, capsys,
                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the threshold router adapts tau (target_rate) from the first step: no warm-up
    options = f"{{{option}: {value}" + (", target_rate: 0.25" if option != "target_rate" and router ==
                                        "threshold" else "") + (", warmup_steps: 0" if router == "threshold"
                                                                else "") + "}"
    status, err = run_cli(fit_args(corpus, f"--model.arch.router={router}",
                              f"--model.arch.router_options={options}", "--trainer.limit_val_batches=1"),
                          capsys)
    if accepted:
        assert status == 0, err[-2000:]
        assert list((tmp_path / "runs").rglob("last.ckpt"))
    else:
        assert f"router_options.{option}" in one_sentence(status, err)


def test_a_topk_sweep_capacity_outside_0_1_is_refused():
    router, sweep = TopKRouter(8), sweep_of(TopKRouter)
    for value in (0, 1.5, -0.5):
        with pytest.raises(ValueError, match=r"A top-k capacity is the fraction .* in \(0, 1\]"):
            with sweep.sweeping(router, value):
                pass
    with sweep.sweeping(router, 1.0):
        assert router.capacity == 1.0
    assert router.capacity == 0.75


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--device=bogus"], r"--device 'bogus' is not a device to run on; give cpu, cuda, cuda:N or mps"),
        (["--device=meta"], r"--device 'meta' is not a device to run on"),
        (["--seed=100000000000000000000000"], r"--seed=100000000000000000000000 is outside the seeds "
                                               r"torch takes, 0 to 2\*\*64 - 1"),
        (["--seed=-1"], r"--seed=-1 is outside the seeds torch takes"),
    ],
    ids=["device_bogus", "device_meta", "seed_huge", "seed_negative"],
)
@pytest.mark.parametrize("command", ["generate", "sweep"])
def test_bad_device_and_seed(command, options, message, checkpoint, tmp_path, capsys):
    out = [f"--out_dir={tmp_path / 'out'}"] if command == "sweep" else []
    status, stdout, err = run_command([command, f"--ckpt_path={checkpoint}", *out, *options], capsys)
    assert re.search(message, one_sentence(status, err))
    assert stdout == "" and not (tmp_path / "out").exists()


@NO_GPU
@pytest.mark.parametrize("command", ["generate", "sweep"])
def test_a_cuda_device_without_a_gpu(command, checkpoint, tmp_path, capsys):
    sentence = one_sentence(*run_cli([command, f"--ckpt_path={checkpoint}", "--device=cuda"], capsys))
    assert "--device cuda needs a CUDA GPU, and torch finds none on this machine" in sentence


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prompt="], r"A prompt is empty; give at least one character"),
        (["--prompt=[]"], r"A prompt is empty"),
        (["--prompt=[ab, '']"], r"A prompt is empty"),
        (["--max_new_tokens=1000000000000"], r"--max_new_tokens=1000000000000 is not a number of tokens "
                                             r"generate continues a prompt by; give one from 0 to 1,000,000"),
        (["--max_new_tokens=-1"], r"--max_new_tokens=-1 is not a number of tokens"),
    ],
    ids=["empty", "no_prompts", "one_empty", "too_many_tokens", "negative_tokens"],
)
def test_bad_generate_options(options, message, checkpoint, capsys):
    status, stdout, err = run_command(["generate", f"--ckpt_path={checkpoint}", *options], capsys)
    assert re.search(message, one_sentence(status, err))
    assert stdout == ""  # not even the prompt is echoed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--values=[]"], r"--values is an empty list; give at least one value, or leave --values out"),
        (["--taus=[]"], r"--taus is an empty list"),
        (["--capacities=[]"], r"--capacities is an empty list"),
        (["--route_kinds=[]"], r"--route_kinds is an empty list"),
        (["--val_batches=0"], r"--val_batches=0 is not a count; give a number of at least 1"),
        (["--fit_batches=0"], r"--fit_batches=0 is not a count"),
        (["--val_batches=-2"], r"--val_batches=-2 is not a count"),
        (["--fit_lr=-1"], r"--fit_lr=-1.0 is not a learning rate; give a positive one"),
    ],
    ids=["values", "taus", "capacities", "route_kinds", "val_batches_0", "fit_batches_0",
         "val_batches_negative", "fit_lr"],
)
def test_bad_sweep_options(options, message, checkpoint, tmp_path, capsys):
    args = ["sweep", f"--ckpt_path={checkpoint}", f"--out_dir={tmp_path / 'out'}", *options]
    assert re.search(message, one_sentence(*run_cli(args, capsys)))
    assert not (tmp_path / "out").exists()


def damage(kind: str, run: Path) -> str:
    """Damage one file of a finished run the way `kind` says; return what the sentence names."""
    metrics = run / "metrics.csv"
    if kind == "not_a_number":
        metrics.write_text("step,flops/total,val/bpb\n0,100,3.0\n1,x,\n")
        return "line 3 has flops/total='x', which is not a number"
    if kind == "step":
        metrics.write_text("step,val/bpb\n1,3.0\ninf,2.5\n")
        return "line 3 has step='inf', which is not a step"
    if kind == "not_text":
        metrics.write_bytes(metrics.read_bytes() + b"\xff\xfe\x00\x81")
        return "cannot be read as CSV"
    if kind == "extra_cells":
        metrics.write_text(metrics.read_text() + "1," * 200 + "\n")
        return "has more cells than the header"
    if kind == "hparams_list":
        (run / "hparams.yaml").write_text("- 1\n- 2\n")
        return "hparams.yaml holds a list, not the mapping of settings a run writes"
    # FLOP totals: the checkpoint's, which compare reads when metrics.csv has none
    metrics.write_text("step,val/bpb\n0,3.0\n")
    ckpt = run / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state["callbacks"]["FlopAccounting"]["forward_flops"] = "x"
    torch.save(state, ckpt)
    return "FLOP totals in"


@pytest.mark.parametrize("kind", ["not_a_number", "step", "not_text", "extra_cells", "hparams_list",
                                  "flop_totals"])
def test_compare_refuses_a_damaged_run(kind, checkpoint, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(checkpoint.parent.parent, run)
    message = damage(kind, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    sentence = one_sentence(*run_cli(["compare", str(run), "--out", str(tmp_path / "out")], capsys))
    assert message in sentence
    assert not (tmp_path / "out").exists()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_study_refuses_a_damaged_metrics_file(tmp_path):
    from nag_lightning.analysis.studies.study import final_val_bpb

    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,val/bpb\n3,2.5\n6,nan?\n")
    with pytest.raises(ValueError, match=r"is damaged: line 3 has val/bpb='nan\?', which is not a number"):
        final_val_bpb(metrics)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["depth", "--depths=[0]"], r"Every depth in --depths is a number of blocks, at least 1; got \[0\]"),
        (["depth", "--depths=[]"], r"--depths is an empty list"),
        (["depth", "--residuals=[../../x]"], r"'../../x' is neither a registered residual strategy nor the "
                                             r"dotted path of a class"),
        (["depth", "--residuals=[]"], r"--residuals is an empty list"),
        (["depth", "--seeds=[]"], r"--seeds is an empty list"),
        (["depth", "--seeds=[-1]"], r"Every seed in --seeds must be from 0 to 4294967295"),
        (["isoflop", "--seeds=[]"], r"--seeds is an empty list"),
        (["isoflop", "--recipes=[]"], r"--recipes is an empty list"),
        (["tradeoff", "--depth=0"], r"--depth=0 is not a count"),
        (["tradeoff", "--seeds=[]"], r"--seeds is an empty list"),
        (["tradeoff", "--val_batches=0"], r"--val_batches=0 is not a count"),
        (["tradeoff", "--residuals=[a/b]"], r"Unknown residual strategy 'a/b'"),
    ],
    ids=["depth_0", "depths_empty", "residual_path", "residuals_empty", "seeds_empty", "seed_negative",
         "isoflop_seeds", "isoflop_recipes", "tradeoff_depth", "tradeoff_seeds", "tradeoff_val_batches",
         "tradeoff_residual"],
)
def test_bad_study_options(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = "--recipes=[{DEBUG}]" if args[0] == "isoflop" else f"--recipe={DEBUG}"
    options = [recipe.format(DEBUG=DEBUG), f"--out={tmp_path / 'out'}"]
    if args[0] == "tradeoff":
        options.append(f"--depth_out={tmp_path / 'depth'}")
    sentence = one_sentence(*run_cli(["study", args[0], *options, *args[1:]], capsys))
    assert re.search(message, sentence), sentence
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run was started
