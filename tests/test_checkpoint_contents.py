"""Everything inside a checkpoint is untrusted, not only its pickle: callback state names no file
outside the run, every command reads a checkpoint file once, data settings touch no file without
the user's say, a tokenizer must fit the model, and damaged contents get one sentence."""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import run_cli

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")
WORDS = "def class return self import for in if else print value index".split()
RUN = Path("runs") / "debug"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("contents")
    (path / "corpus.txt").write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(4000)))
    return path


def data_args(workdir: Path) -> list[str]:
    return [f"--data.source={workdir / 'corpus.txt'}", f"--data.cache_dir={workdir / 'cache'}"]


def fit(workdir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", DEBUG, *data_args(workdir), "--trainer.enable_progress_bar=false", *extra]


@pytest.fixture(scope="module")
def trained(workdir) -> Path:
    """A run of three steps (one validation, so a top-k checkpoint too), in its own folder."""
    folder = workdir / "trained"
    folder.mkdir()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        status, err = run_cli(fit(workdir, "--trainer.max_steps=3"), CapsysStub())
        assert status == 0, err
    finally:
        os.chdir(cwd)
    return folder


class CapsysStub:
    """`run_cli` outside a test function (a module fixture): nothing captured."""

    def readouterr(self):
        class Captured:
            out = err = ""
        return Captured()


def last_of(folder: Path) -> Path:
    return folder / RUN / "version_0" / "checkpoints" / "last.ckpt"


def copy_run(trained: Path, to: Path) -> Path:
    """A copy of the trained run's folder under `to` (each test edits its own)."""
    shutil.copytree(trained / "runs", to / "runs")
    return last_of(to)


def edited(source: Path, out: Path, edit) -> Path:
    """A copy of checkpoint `source` with `edit(checkpoint dict)` applied: plain data only."""
    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, out)
    return out


def one_sentence(status: int, err: str) -> str:
    assert status == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("nag-lightning: error:")]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    return lines[0]


def sweep_args(ckpt: str, workdir: Path, out: Path, *extra: str, data: bool = True) -> list[str]:
    own = [f"--source={workdir / 'corpus.txt'}", f"--cache_dir={workdir / 'cache'}"] if data else []
    return ["sweep", f"--ckpt_path={ckpt}", f"--out_dir={out}", *own, "--val_batches=1",
            "--fit_batches=1", "--taus=[0.0]", *extra]


def files_outside(root: Path, run: Path) -> dict[str, float]:
    """Every file under `root` but outside `run`, with its modification time."""
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file() and run not in p.parents}


# ---- 1. callback state names no file outside the run -------------------------------------------


def callback_state(checkpoint: dict) -> dict:
    return next(v for k, v in checkpoint["callbacks"].items() if k.startswith("RunCheckpoint"))


@pytest.mark.parametrize("resume", ["last", "file"])
def test_crafted_callback_paths_delete_and_write_nothing_outside_the_run(
        resume, trained, workdir, tmp_path, capsysbinary, monkeypatch):
    last = copy_run(trained, tmp_path)
    victim = tmp_path / "victim.ckpt"
    victim.write_text("kept")
    # the run folder the resumed run writes into: its own for `last`, a new version for a file
    version = "version_0" if resume == "last" else "version_1"
    outside = f"{RUN}/{version}/checkpoints/../../../../victim.ckpt"

    def craft(checkpoint: dict) -> None:
        state = callback_state(checkpoint)
        state.update(best_model_path=outside, kth_best_model_path=outside, last_model_path=outside,
                     best_k_models={outside: torch.tensor(9.0)}, best_model_score="x",
                     kth_value=torch.tensor(9.0), dirpath=f"{RUN}/{version}/checkpoints")

    if resume == "last":
        edited(last, last, craft)
        ckpt = "last"
    else:
        ckpt = str(edited(last, tmp_path / "crafted.ckpt", craft))
    monkeypatch.chdir(tmp_path)
    before = files_outside(tmp_path, tmp_path / "runs")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        status, err = run_cli(fit(workdir, f"--ckpt_path={ckpt}", "--trainer.max_steps=9",
                                  "--trainer.val_check_interval=1"), capsysbinary)
    assert status == 0, err[-3000:]
    assert victim.is_file() and victim.read_text() == "kept"
    assert files_outside(tmp_path, tmp_path / "runs") == before
    dropped = [str(w.message) for w in said if "which were dropped" in str(w.message)]
    assert len(dropped) == 1 and "best_model_path=" in dropped[0] and "victim.ckpt" in dropped[0]
    # the run itself trained on, validating and saving at every step
    last = tmp_path / RUN / version / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 9


def test_trusted_state_keeps_paths_inside_the_folder_only(tmp_path):
    from nag_lightning.callbacks.run_checkpoint import trusted_state

    folder = tmp_path / "run" / "checkpoints"
    inside, escaping = str(folder / "a.ckpt"), str(folder / ".." / ".." / "a.ckpt")
    linked = folder / "out"  # a link inside the folder that leads out of it
    folder.mkdir(parents=True)
    linked.symlink_to(tmp_path)
    state = trusted_state({"dirpath": str(folder), "best_model_path": inside, "last_model_path": escaping,
                           "kth_best_model_path": str(linked / "a.ckpt"), "best_model_score": [1],
                           "best_k_models": {inside: torch.tensor(1.0), escaping: torch.tensor(2.0),
                                             str(folder / "b.ckpt"): "x"}},
                          str(folder))
    assert state["best_model_path"] == inside
    assert state["last_model_path"] == state["kth_best_model_path"] == ""
    assert state["best_model_score"] is None
    assert list(state["best_k_models"]) == [inside]
    remote = trusted_state({"best_model_path": "s3://b/run/ckpt/../../x.ckpt",
                            "last_model_path": "s3://b/run/ckpt/last.ckpt"}, "s3://b/run/ckpt")
    assert remote["best_model_path"] == "" and remote["last_model_path"] == "s3://b/run/ckpt/last.ckpt"


@pytest.mark.parametrize("where, value, said", [
    ("global_step", "x", "global_step='x' is not a non-negative integer"),
    ("loops", "garbage", "loops is not a mapping"),
    ("progress", -3, "is not a non-negative integer"),
    ("flops", "x", "FlopAccounting state holds forward_flops='x'"),
    ("loader", [{"dataset": {"seed": "x"}}], "data loader state does not fit this data"),
])
def test_garbage_numbers_in_a_checkpoint_are_one_sentence(where, value, said, trained, workdir,
                                                          tmp_path, capsysbinary, monkeypatch):
    def craft(checkpoint: dict) -> None:
        if where == "progress":
            checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] = value
        elif where == "loader":
            checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = value
        elif where == "flops":
            checkpoint["callbacks"]["FlopAccounting"]["forward_flops"] = value
        else:
            checkpoint[where] = value

    ckpt = edited(last_of(trained), tmp_path / "garbage.ckpt", craft)
    monkeypatch.chdir(tmp_path)
    args = fit(workdir, f"--ckpt_path={ckpt}", "--trainer.max_steps=5")
    sentence = one_sentence(*run_cli(args, capsysbinary))
    assert said in sentence


def test_garbage_depth_history_is_dropped_with_a_warning():
    from nag_lightning.callbacks import DepthDiagnostics

    entry = {"step": 3, "labels": ["0_attn"], "mean": [0.1], "norm": [1.0],
             "q0.1": [0.0], "q0.5": [0.1], "q0.9": [0.2]}
    callback = DepthDiagnostics()
    with pytest.warns(UserWarning, match="holds 2 entries that are not depth diagnostics"):
        callback.load_state_dict({"history": [{**entry, "step": "x"}, entry, {**entry, "mean": "ab"}]})
    assert callback.history == [entry]


# ---- 2. every command reads a checkpoint file once ---------------------------------------------


@pytest.fixture
def counted_reads(monkeypatch):
    """How often torch.load read each file (by resolved path), whoever called it."""
    reads: dict[str, int] = {}
    load = torch.load

    def counting(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            key = os.path.realpath(f)
            reads[key] = reads.get(key, 0) + 1
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    return reads


@pytest.mark.parametrize("name", ["generate", "sweep", "validate", "test", "fit-file", "fit-last",
                                  "compare"])
def test_every_command_reads_a_checkpoint_file_exactly_once(name, trained, workdir, tmp_path, capsysbinary,
                                                            monkeypatch, counted_reads):
    last = copy_run(trained, tmp_path)
    # without FLOP columns in its metrics, compare reads the totals from the run's last.ckpt
    (last.parents[1] / "metrics.csv").write_text("step,val/bpb\n1,3.0\n")
    monkeypatch.chdir(tmp_path)
    lightning = ["--config", DEBUG, *data_args(workdir), f"--ckpt_path={last}"]
    args = {
        "generate": ["generate", f"--ckpt_path={last}", "--max_new_tokens=2"],
        "sweep": sweep_args(str(last), workdir, tmp_path / "sweep"),
        "validate": ["validate", *lightning],
        "test": ["test", *lightning],
        "fit-file": fit(workdir, f"--ckpt_path={last}", "--trainer.max_steps=4"),
        "fit-last": fit(workdir, "--ckpt_path=last", "--trainer.max_steps=4"),
        "compare": ["compare", str(last.parents[1]), "--out", str(tmp_path / "compare")],
    }[name]
    status, err = run_cli(args, capsysbinary)
    assert status == 0, err[-3000:]
    assert counted_reads.get(os.path.realpath(last)) == 1, counted_reads


def test_the_trainer_restores_the_dict_already_read(trained, workdir, tmp_path, capsysbinary, monkeypatch):
    """A file swapped after the command read it changes nothing: Lightning restores the state read
    and checked first, not what the path holds by then."""
    from nag_lightning.training import lightning_cli as cli

    last = copy_run(trained, tmp_path)
    install = cli.preloaded_checkpoint_io

    def swap_then_install(inner, saved):
        Path(saved.source).write_bytes(b"swapped")
        return install(inner, saved)

    monkeypatch.setattr(cli, "preloaded_checkpoint_io", swap_then_install)
    monkeypatch.chdir(tmp_path)
    args = ["validate", "--config", DEBUG, *data_args(workdir), f"--ckpt_path={last}"]
    status, err = run_cli(args, capsysbinary)
    assert status == 0, err[-3000:]
    assert last.read_bytes() == b"swapped"


# ---- 3. data settings touch no file without the user's say -------------------------------------


def test_sweep_uses_data_files_a_checkpoint_names_only_with_the_users_say(trained, workdir, tmp_path,
                                                                         capsysbinary, monkeypatch):
    elsewhere = tmp_path / "elsewhere"

    def craft(checkpoint: dict) -> None:
        checkpoint["datamodule_hyper_parameters"].update(cache_dir=str(elsewhere))

    ckpt = str(edited(last_of(trained), tmp_path / "data.ckpt", craft))
    monkeypatch.chdir(tmp_path)
    sentence = one_sentence(*run_cli(sweep_args(ckpt, workdir, tmp_path / "s", data=False), capsysbinary))
    assert str(workdir / "corpus.txt") in sentence and str(elsewhere) in sentence
    assert "--source and --cache_dir" in sentence and "--trust_checkpoint" in sentence
    assert not elsewhere.exists() and not (tmp_path / "s").exists()
    # the user names the corpus but not the folder: the saved folder is still refused
    corpus = f"--source={workdir / 'corpus.txt'}"
    only_source = [*sweep_args(ckpt, workdir, tmp_path / "s", data=False), corpus]
    sentence = one_sentence(*run_cli(only_source, capsysbinary))
    assert "(cache_dir=" in sentence and "source='" not in sentence
    assert not elsewhere.exists()
    # trusted: the saved settings are used, the corpus tokenized into the saved folder
    status, err = run_cli(sweep_args(ckpt, workdir, tmp_path / "s", "--trust_checkpoint=true", data=False),
                          capsysbinary)
    assert status == 0, err[-2000:]
    assert elsewhere.is_dir()


# ---- 4. a tokenizer must fit the model, and its failures are sentences -------------------------


def tokenizer_json(vocab: dict[str, int], split: str | None = None) -> str:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    if split is not None:
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    text = hf.to_str()
    if vocab and max(vocab.values()) >= 2**24:  # beyond what the library lets one build
        config = json.loads(text)
        config["model"]["vocab"] = vocab
        text = json.dumps(config)
    return text


TOKENIZERS = {
    "backtracking": (tokenizer_json({"a": 0, "b": 1, **{f"<{i}>": i for i in range(2, 256)}}, "(a+)+$"),
                     "failed while encoding"),
    "beyond": (tokenizer_json({"a": 0, "b": 300}), "beyond the model's vocabulary of 256 ids"),
    "near-2**31": (tokenizer_json({"a": 0, "b": 2**31 - 2}), "token id of 2147483646"),
    "fewer-ids": (tokenizer_json({"a": 0, "b": 9}), "a tokenizer of 10, which cannot decode"),
    "empty": (json.dumps({**json.loads(tokenizer_json({"a": 0})), "model": {
        **json.loads(tokenizer_json({"a": 0}))["model"], "vocab": {}}}), "empty vocabulary"),
}


@pytest.mark.parametrize("case", list(TOKENIZERS))
@pytest.mark.parametrize("name", ["generate", "sweep"])
def test_a_tokenizer_that_does_not_fit_or_fails_is_one_sentence(name, case, trained, workdir, tmp_path,
                                                                capsysbinary, monkeypatch):
    text, said = TOKENIZERS[case]
    if name == "sweep" and case in ("backtracking", "fewer-ids"):
        pytest.skip("the sweep neither encodes nor decodes with the checkpoint's tokenizer")

    def craft(checkpoint: dict) -> None:
        checkpoint["tokenizer"] = {"spec": "crafted.json", "json": text}

    ckpt = str(edited(last_of(trained), tmp_path / "tok.ckpt", craft))
    monkeypatch.chdir(tmp_path)
    args = (["generate", f"--ckpt_path={ckpt}", "--prompt", "a" * 40 + "b", "--max_new_tokens=1"]
            if name == "generate" else sweep_args(ckpt, workdir, tmp_path / "s"))
    assert said in one_sentence(*run_cli(args, capsysbinary))


# ---- 5. checkpoints by URL ----------------------------------------------------------------------


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def served(trained, tmp_path, monkeypatch):
    """The trained run served over http on 127.0.0.1, downloads into this test's torch.hub cache."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    handler = functools.partial(QuietHandler, directory=str(trained))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("name", ["generate", "validate", "sweep"])
def test_a_checkpoint_by_url_is_fetched_and_read_once(name, served, workdir, tmp_path, capsysbinary,
                                                      monkeypatch, counted_reads):
    monkeypatch.chdir(tmp_path)
    url = f"{served}/{RUN}/version_0/checkpoints/last.ckpt"
    fetches = []
    download = torch.hub.download_url_to_file

    def counted_download(*args, **kwargs):
        fetches.append(args)
        return download(*args, **kwargs)

    monkeypatch.setattr(torch.hub, "download_url_to_file", counted_download)
    args = {
        "generate": ["generate", f"--ckpt_path={url}", "--max_new_tokens=2"],
        "validate": ["validate", "--config", DEBUG, *data_args(workdir), f"--ckpt_path={url}"],
        "sweep": sweep_args(url, workdir, tmp_path / "s"),
    }[name]
    status, err = run_cli(args, capsysbinary)
    assert status == 0, err[-3000:]
    assert len(fetches) == 1
    assert list(counted_reads.values()) == [1], counted_reads


@pytest.mark.parametrize("tail", ["/", "/..", "/."])
def test_a_url_naming_no_file_is_one_sentence_and_leaves_nothing(tail, served, tmp_path, capsysbinary,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"{served}/{RUN}{tail}"
    sentence = one_sentence(*run_cli(["generate", f"--ckpt_path={url}"], capsysbinary))
    assert "names no file" in sentence
    hub = tmp_path / "torch_home"
    assert not hub.exists() or not [p for p in hub.rglob("*") if p.is_file()]


def test_sweep_of_a_url_writes_into_the_working_directory(served, workdir, tmp_path, capsysbinary,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"{served}/{RUN}/version_0/checkpoints/last.ckpt"
    args = [a for a in sweep_args(url, workdir, tmp_path) if not a.startswith("--out_dir")]
    status, err = run_cli(args, capsysbinary)
    assert status == 0, err[-2000:]
    assert (tmp_path / "sweep-last" / "sweep.csv").is_file()
    assert not (tmp_path / "http:").exists()


# ---- 8. a damaged last.ckpt ---------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_resuming_from_a_damaged_last_names_it_and_the_checkpoint_to_use(damage, trained, workdir,
                                                                         tmp_path, capsysbinary, monkeypatch):
    last = copy_run(trained, tmp_path)
    data = last.read_bytes()
    last.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    other = next(last.parent.glob("step*.ckpt"))
    monkeypatch.chdir(tmp_path)
    sentence = one_sentence(*run_cli(fit(workdir, "--ckpt_path=last", "--trainer.max_steps=5"), capsysbinary))
    assert f"{RUN / 'version_0' / 'checkpoints' / 'last.ckpt'}" in sentence and "is damaged" in sentence
    assert f"--ckpt_path {RUN / 'version_0' / 'checkpoints' / other.name}" in sentence
    other.unlink()
    sentence = one_sentence(*run_cli(fit(workdir, "--ckpt_path=last", "--trainer.max_steps=5"), capsysbinary))
    assert "no other checkpoint" in sentence and "start a new run" in sentence


# ---- bad contents: shapes, settings, weights ---------------------------------------------------


def wrong_shape(checkpoint: dict) -> None:
    checkpoint["state_dict"]["model.embed.weight"] = torch.zeros(256, 16)


CONTENTS = {
    "wrong-shapes": (wrong_shape, "embed.weight is [256, 16], the model's [256, 32]"),
    "no-hyper-parameters": (lambda c: c.pop("hyper_parameters"), "no hyper_parameters"),
    "no-state-dict": (lambda c: c.pop("state_dict"), "no state_dict"),
}


@pytest.mark.parametrize("case", list(CONTENTS))
@pytest.mark.parametrize("name", ["generate", "sweep", "validate"])
def test_checkpoint_contents_that_do_not_fit_are_one_sentence(name, case, trained, workdir, tmp_path,
                                                              capsysbinary, monkeypatch):
    edit, said = CONTENTS[case]
    ckpt = str(edited(last_of(trained), tmp_path / "bad.ckpt", edit))
    monkeypatch.chdir(tmp_path)
    args = {
        "generate": ["generate", f"--ckpt_path={ckpt}", "--max_new_tokens=1"],
        "sweep": sweep_args(ckpt, workdir, tmp_path / "s"),
        "validate": ["validate", "--config", DEBUG, *data_args(workdir), f"--ckpt_path={ckpt}"],
    }[name]
    assert said in one_sentence(*run_cli(args, capsysbinary))
