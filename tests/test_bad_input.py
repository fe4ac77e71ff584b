"""Bad input ends the command with one sentence and exit status 1, never a traceback: one test per
class of input (unreadable checkpoints, cache folders, plugin options, vocabulary, step limits,
object stores, file:// URIs)."""

from __future__ import annotations

import io
import os
import pathlib
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache_dir(corpus) -> Path:
    return corpus.parent / "cache"


def one_sentence(status: int, err: str) -> str:
    """The single error line of a run that must have failed on bad input."""
    assert status == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("nag-lightning: error:")]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err and "weights_only=False" not in err
    return lines[0]


def fit(corpus: Path, cache_dir: Path | str, *extra: str) -> list[str]:
    return ["fit", "--config", DEBUG, f"--data.source={corpus}", f"--data.cache_dir={cache_dir}",
            "--trainer.enable_progress_bar=false", *extra]


def bad_checkpoint(kind: str, path: Path) -> Path:
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(os.urandom(4096))
    else:  # a real torch file cut in half, as an interrupted copy leaves it
        buffer = io.BytesIO()
        torch.save({"state_dict": {"w": torch.ones(4096)}, "hyper_parameters": {}}, buffer)
        path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    return path


@pytest.mark.parametrize("kind", ["empty", "truncated", "random"])
@pytest.mark.parametrize("name", ["fit", "validate", "sweep", "generate"])
def test_an_unreadable_checkpoint(name, kind, corpus, cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = bad_checkpoint(kind, tmp_path / f"{kind}.ckpt")
    args = {
        "fit": fit(corpus, cache_dir, f"--ckpt_path={ckpt}"),
        "validate": ["validate", "--config", DEBUG, f"--ckpt_path={ckpt}"],
        "sweep": ["sweep", f"--ckpt_path={ckpt}", f"--out_dir={tmp_path}"],
        "generate": ["generate", f"--ckpt_path={ckpt}"],
    }[name]
    sentence = one_sentence(*run_cli(args, capsys))
    assert f"The checkpoint {ckpt} is not a readable checkpoint" in sentence


def test_a_cache_dir_that_is_a_file(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("x")
    sentence = one_sentence(*run_cli(fit(corpus, a_file), capsys))
    assert "is a file, not a folder" in sentence
    sentence = one_sentence(*run_cli(fit(corpus, a_file / "cache"), capsys))
    assert "cannot hold the token cache" in sentence
    assert a_file.read_text() == "x"


def test_a_read_only_cache_dir(corpus, tmp_path, capsys, monkeypatch):
    # Tests run as root, whom file modes do not stop: the file system refuses instead.
    monkeypatch.chdir(tmp_path)
    read_only = tmp_path / "read_only"
    mkdir = pathlib.Path.mkdir

    def refuse(self, *args, **kwargs):
        if read_only in (self, *self.parents):
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    sentence = one_sentence(*run_cli(fit(corpus, read_only), capsys))
    assert "cannot hold the token cache (Permission denied" in sentence
    assert "give a folder you can write to" in sentence


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model.arch.residual_options={theta_maxx: 1.0}"],
         r"model.arch.residual_options \(beside NAG's own: angle, bound, theta_max, .*kernel\) has "
         r"'theta_maxx', which the NAG angle 'gate' does not take; it accepts: gate_gain, .*angle_cost\."),
        (["--model.arch.router=topk", "--model.arch.router_options={cap: 0.5}"],
         r"model.arch.router_options has 'cap', which the router 'topk' does not take; it accepts: "
         r"capacity"),
        (["--model.arch.vocab_size=100"],
         r"model.arch.vocab_size=100 does not match the 256 token ids of data.tokenizer='bytes'; leave "
         r"model.arch.vocab_size out: it follows data.tokenizer"),
        (["--trainer.max_steps=-5"], r"trainer.max_steps=-5 is not a number of steps"),
        (["--trainer.max_steps=0"], r"trainer.max_steps=0 would train nothing"),
        (["--data.source=file://elsewhere/corpus.txt"], r"names a file on another host"),
    ],
    ids=["residual_options", "router_options", "vocab_size", "max_steps_negative", "max_steps_0",
         "file_uri_other_host"],
)
def test_bad_settings(extra, message, corpus, cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sentence = one_sentence(*run_cli(fit(corpus, cache_dir, *extra), capsys))
    assert re.search(message, sentence), sentence
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.ckpt"))


def test_an_object_store_without_credentials(corpus, cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    # no credential files, and no instance metadata service to ask: nothing touches the network
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    status, err = run_cli(["fit", "--config", DEBUG, "--data.source=s3://nag-bucket/corpus",
                           f"--data.cache_dir={cache_dir}"], capsys)
    sentence = one_sentence(status, err)
    assert "No credentials were found to read data.source 's3://nag-bucket/corpus" in sentence
    assert "AWS_ACCESS_KEY_ID" in sentence


def test_a_file_uri_is_the_local_path(corpus, cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(fit(f"file://{corpus}", cache_dir, "--trainer.max_steps=1",
                              "--trainer.limit_val_batches=0"), capsys)
    assert status == 0, err[-2000:]
    assert list(tmp_path.rglob("last.ckpt"))


def test_compare_with_an_unreadable_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,val/bpb\n1,3.0\n")
    bad_checkpoint("truncated", run / "checkpoints" / "last.ckpt")
    sentence = one_sentence(*run_cli(["compare", str(run), "--out", str(tmp_path / "out")], capsys))
    assert "is not a readable checkpoint" in sentence
