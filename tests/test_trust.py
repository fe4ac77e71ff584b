"""Checkpoints are untrusted input: no checkpoint, local or remote, runs code of its own, and a
plugin it names by class path loads only through the registries or with --trust_checkpoint."""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

import pytest
import torch

from nag_lightning.checkpoints.trust import untrusted_plugins
from nag_lightning.cli import main, run_lightning_cli
from nag_lightning.residuals.nag import NAGResidual
from nag_lightning.training.module import LanguageModel
from tests.helpers import run_cli

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")
WORDS = "def class return self import for in if else print value index".split()

pytestmark = pytest.mark.usefixtures("one_thread")


class PlainNag(NAGResidual):
    """A plugin outside the package and outside every registry, as a user's own would be."""


class Payload:
    """Unpickling this opens (so creates) `marker` for writing: code run by loading a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trust")
    (path / "corpus.txt").write_text(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(4000)))
    return path


def data_args(workdir: Path) -> list[str]:
    return [f"--data.source={workdir / 'corpus.txt'}", f"--data.cache_dir={workdir / 'cache'}"]


@pytest.fixture(scope="module")
def checkpoint(workdir) -> Path:
    """A real checkpoint of two steps of the debug recipe."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        main(["fit", "--config", DEBUG, *data_args(workdir), "--trainer.max_steps=2",
              "--trainer.enable_progress_bar=false"])
    finally:
        os.chdir(cwd)
    return next(workdir.rglob("last.ckpt"))


@pytest.fixture(scope="module")
def served(workdir):
    """An http server on 127.0.0.1 serving `workdir`, stopped after the module or a minute."""
    handler = functools.partial(QuietHandler, directory=str(workdir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Timer(60, server.shutdown)
    stop.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    stop.cancel()
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(autouse=True)
def torch_home(tmp_path, monkeypatch):
    """Downloads go to this test's own torch.hub cache."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))


def one_sentence(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("nag-lightning: error:")]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err and "weights_only=False" not in err
    return lines[0]


def command(name: str, ckpt: str, workdir: Path, *extra: str) -> list[str]:
    """`name` run on checkpoint `ckpt` with the test's small corpus."""
    if name in ("fit", "validate"):
        return [name, "--config", DEBUG, *data_args(workdir), f"--ckpt_path={ckpt}", *extra]
    if name == "sweep":
        return ["sweep", f"--ckpt_path={ckpt}", f"--out_dir={workdir / 'sweep'}",
                f"--source={workdir / 'corpus.txt'}", f"--cache_dir={workdir / 'cache'}",
                "--val_batches=1", "--fit_batches=1", "--taus=[0.0]", *extra]
    return ["generate", f"--ckpt_path={ckpt}", "--max_new_tokens=2", *extra]


COMMANDS = ["fit", "validate", "sweep", "generate"]


@pytest.mark.parametrize("where", ["url", "local"])
@pytest.mark.parametrize("name", COMMANDS)
def test_a_checkpoint_that_would_run_code_is_refused(name, where, workdir, served, tmp_path, capsys,
                                                     monkeypatch):
    marker = tmp_path / "marker"
    evil = workdir / f"evil_{name}_{where}.ckpt"
    torch.save({"state_dict": {}, "payload": Payload(marker)}, evil)
    ckpt = f"{served}/{evil.name}" if where == "url" else str(evil)
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(command(name, ckpt, workdir), capsys)
    assert status == 1
    assert "holds objects other than tensors and plain data" in one_sentence(err)
    assert not marker.exists()
    # a refused download is not left in the cache for a loader that trusts URLs
    assert not list((tmp_path / "torch_home").rglob("*.ckpt"))


def test_a_remote_checkpoint_loads_with_weights_only(checkpoint, workdir, served, capsysbinary):
    url = f"{served}/{checkpoint.relative_to(workdir)}"
    status, err = run_cli(command("generate", url, workdir), capsysbinary)
    assert status == 0, err[-2000:]


def with_settings(checkpoint: Path, out: Path, **settings) -> Path:
    """A copy of `checkpoint` whose saved model settings are changed: plain data only, so it
    passes the weights-only reader."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    saved["hyper_parameters"]["arch"].update(settings)
    torch.save(saved, out)
    return out


def basic_config_payloads(victim: Path) -> dict[str, dict]:
    """Saved settings that make building the model call logging.basicConfig, which truncates
    `victim` (filemode w), by either form of class path, as residual or as router."""
    args = {"filename": str(victim), "filemode": "w", "force": True}
    path = "logging.basicConfig"
    return {
        "residual-mapping": {"residual": {"class_path": path, "init_args": args}},
        "router-mapping": {"router": {"class_path": path, "init_args": args}},
        "residual-string": {"residual": path, "residual_options": args},
        "router-string": {"router": path, "router_options": args},
    }


@pytest.mark.parametrize("payload", list(basic_config_payloads(Path())))
@pytest.mark.parametrize("name", ["validate", "sweep", "generate"])
def test_a_class_path_saved_in_a_checkpoint_is_not_called(name, payload, checkpoint, workdir,
                                                          tmp_path, capsys, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    ckpt = with_settings(checkpoint, tmp_path / "p.ckpt", **basic_config_payloads(victim)[payload])
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(command(name, str(ckpt), workdir), capsys)
    assert status == 1
    sentence = one_sentence(err)
    assert "'logging.basicConfig'" in sentence and "--trust_checkpoint" in sentence
    assert victim.read_text() == "kept"


def test_an_out_of_package_plugin_loads_when_trusted_or_configured(checkpoint, workdir, tmp_path,
                                                                   capsysbinary, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plugin = f"{__name__}.PlainNag"
    ckpt = str(with_settings(checkpoint, tmp_path / "plugin.ckpt", residual=plugin))

    status, err = run_cli(command("generate", ckpt, workdir), capsysbinary)
    assert status == 1 and f"'{__name__}.PlainNag'" in one_sentence(err)
    for name in ("generate", "sweep", "validate"):
        status, err = run_cli(command(name, ckpt, workdir, "--trust_checkpoint=true"), capsysbinary)
        assert status == 0, (name, err[-2000:])
    # the user's own config names the same class path: their code, no flag needed
    status, err = run_cli(
        command("validate", ckpt, workdir, f"--model.arch.residual={plugin}"),
        capsysbinary,
    )
    assert status == 0, err[-2000:]


def test_registered_plugins_by_any_name_need_no_trust():
    nag_path = f"{NAGResidual.__module__}.{NAGResidual.__qualname__}"
    assert untrusted_plugins({"residual": "nag", "router": {"class_path": "topk"}}) == []
    assert untrusted_plugins({"residual": {"class_path": nag_path}, "router": "none"}) == []
    assert untrusted_plugins({"residual": "os.system"}) == ["model.arch.residual='os.system'"]
    assert untrusted_plugins({"residual": "os.system"}, {"residual": "os.system"}) == []


def test_resuming_says_the_checkpoint_settings_win(checkpoint, workdir, tmp_path, capsys,
                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = run_lightning_cli(["fit", "--config", DEBUG, *data_args(workdir), f"--ckpt_path={checkpoint}",
                             "--model.lr=0.5", "--trainer.max_steps=3",
                             "--trainer.enable_progress_bar=false"])
    err = capsys.readouterr().err
    assert "model.lr=0.003 (not 0.5)" in err and "which win over this run's" in err
    assert cli.model.hparams.lr == 0.003
    assert cli.trainer.optimizers[0].param_groups[0]["initial_lr"] == 0.003


def test_weights_only_false_is_refused(checkpoint, workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(command("validate", str(checkpoint), workdir, "--weights_only=false"), capsys)
    assert status == 1 and "weights_only=True only" in one_sentence(err)
    assert "drop --weights_only false" in err
    with pytest.raises(ValueError, match="weights_only=True only.*leave weights_only unset"):
        LanguageModel.load_from_checkpoint(checkpoint, weights_only=False)
