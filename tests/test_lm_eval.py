"""`nag-lightning eval` and the lm-eval model `nag-lightning`, offline on the local tasks of
tests/lm_eval_tasks/ (their documents are JSONL files beside them). Tests that run lm-eval skip
where it is not installed: it is an optional extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nag_lightning
from nag_lightning.analysis.evaluation.checkpoint import evaluate
from nag_lightning.analysis.evaluation.generate import generate
from nag_lightning.checkpoints.export import export_checkpoint
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.data.bpe_training import train_bpe
from nag_lightning.data.tokenizer import HFTokenizer
from tests.helpers import run_cli, run_command
from tests.test_export import said_once, save_like_fit, tiny_module

pytestmark = pytest.mark.usefixtures("one_thread")
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
# Bytes: short windows, so every document (its length padded to whole windows) spans several; a
# BPE: one window holds every document.
SEQ_LEN = {"bytes": 16, "bpe": 128}


def documents(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text(encoding="utf-8").splitlines() if line]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def exported_model(root: Path, tokenizer: str) -> Path:
    """A tiny NAG model with threshold routing (so lm-eval's padded batches meet MoD), exported."""
    if tokenizer == "bytes":
        module = tiny_module("nag", "threshold", seq_len=SEQ_LEN[tokenizer])
    else:
        code = [d["text"] for d in documents("texts.jsonl")] * 20
        bpe = HFTokenizer(train_bpe(code, 300), "bpe:300")
        module = tiny_module("nag", "threshold", seq_len=SEQ_LEN[tokenizer], vocab_size=bpe.vocab_size)
        module.set_tokenizer(bpe)
    return export_checkpoint(str(save_like_fit(module, root / f"{tokenizer}.ckpt")), str(root / tokenizer))


def run_eval(folder: Path, out: Path, tasks: str, capsys, *options: str) -> dict:
    status, stdout, err = run_command(["eval", "--ckpt_path", str(folder), "--tasks", tasks,
                                       "--include_path", str(TASKS), "--output", str(out),
                                       "--batch_size", "4", *options], capsys)
    assert status == 0, err
    assert "|" in stdout  # lm-eval's table
    return json.loads(out.read_text())


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_rolling_bits_per_byte_equal_the_packages_own_evaluation_of_the_same_windows(tmp_path, capsys,
                                                                                     tokenizer):
    """lm-eval's bits_per_byte of nag_local_rolling (each document's rolling log-likelihood over
    windows of seq_len predictions, the first predicted from the prefix token, a newline; summed
    over documents, over their UTF-8 bytes) against `nag_lightning.analysis.evaluation.checkpoint.evaluate`
    on the same token rows: per document, [newline] + its tokens cut into rows of seq_len + 1
    tokens that overlap by one (the data module's layout), each row run alone. The two layouts
    are the same windows when each document fills whole windows (lm-eval gives a last, partial
    window more context than a row of its own would have): the byte documents are padded to
    multiples of 16 bytes, and every BPE document fits one window."""
    pytest.importorskip("lm_eval")
    folder = exported_model(tmp_path, tokenizer)
    results = run_eval(folder, tmp_path / "out.json", "[nag_local_rolling]", capsys)
    theirs = results["results"]["nag_local_rolling"]["bits_per_byte,none"]

    loaded = load_model(folder)
    model, tok, seq_len = loaded.model, loaded.tokenizer, SEQ_LEN[tokenizer]
    rows = []
    for doc in documents("texts.jsonl"):
        stream = tok.encode(b"\n").tolist()[:1] + tok.encode(doc["text"].encode()).tolist()
        assert (len(stream) - 1) % seq_len == 0 or len(stream) <= seq_len + 1
        rows += [torch.tensor([stream[k: k + seq_len + 1]]) for k in range(0, len(stream) - 1, seq_len)]
    if tokenizer == "bytes":
        assert len(rows) > 2 * len(documents("texts.jsonl"))  # several windows per document
    ours = evaluate(model, rows, tok.byte_lengths if tokenizer != "bytes" else None)["bpb"]
    assert abs(theirs - ours) < 1e-4, (theirs, ours)


@pytest.fixture(scope="module")
def bytes_model(tmp_path_factory) -> Path:
    return exported_model(tmp_path_factory.mktemp("bytes"), "bytes")


def test_multiple_choice_and_generation_answer_as_the_model_does(bytes_model, tmp_path, capsys):
    """nag_local_choice: lm-eval's accuracy against the choice of highest log-likelihood after
    the question, computed here on whole sequences; nag_local_generate: its answers against the
    package's own greedy generation of the question, cut at the first newline."""
    pytest.importorskip("lm_eval")
    results = run_eval(bytes_model, tmp_path / "out.json", "nag_local_choice,nag_local_generate", capsys)
    model = load_model(bytes_model).model
    docs = documents("choices.jsonl")

    def loglikelihood(context: str, continuation: str) -> float:
        ids = list(context.encode() + continuation.encode())[-(SEQ_LEN["bytes"] + 1):]
        with torch.no_grad():
            logprobs = F.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
        n = min(len(continuation.encode()), len(ids) - 1)
        return sum(logprobs[len(ids) - 1 - n + j, ids[len(ids) - n + j]].item() for j in range(n))

    right = [max(range(len(d["choices"])), key=lambda c: loglikelihood(d["question"], d["choices"][c]))
             == d["answer"] for d in docs]
    assert results["results"]["nag_local_choice"]["acc,none"] == pytest.approx(sum(right) / len(docs))

    answers = {s["doc"]["question"]: s["resps"][0][0] for s in results["samples"]["nag_local_generate"]}
    for doc in docs:
        ours = generate(str(bytes_model), doc["question"], max_new_tokens=8, stop="\n")
        assert answers[doc["question"]] == ours.text.split("\n")[0]


def test_lm_evals_own_command_finds_the_model(bytes_model, tmp_path):
    """`python -m nag_lightning.analysis.lm_eval_model` (the path of earlier releases) is lm-eval's
    command with the model registered (lm-eval discovers no plugins), and lm-eval's registry gives
    the class by name."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    from nag_lightning.analysis.evaluation.lm_eval_model import NagLM

    assert get_model("nag-lightning") is NagLM
    env = {**os.environ, "PYTHONPATH": str(Path(nag_lightning.__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "nag_lightning.analysis.lm_eval_model", "--model", "nag-lightning",
         "--model_args", f"ckpt={bytes_model}", "--tasks", "nag_local_choice", "--include_path", str(TASKS),
         "--limit", "2", "--batch_size", "2", "--device", "cpu"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nag_local_choice" in done.stdout and "acc" in done.stdout


def test_eval_refuses_bad_options_in_one_sentence(bytes_model, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    base = ["eval", "--ckpt_path", str(bytes_model), "--include_path", str(TASKS)]
    status, err = run_cli([*base, "--tasks", "[no_such_task]"], capsys)
    assert status == 1 and said_once(err, "lm-eval knows no task no_such_task"), err
    status, err = run_cli([*base, "--tasks", "[nag_local_choice]", "--batch_size", "0"], capsys)
    assert status == 1 and said_once(err, "batch_size=0"), err
    (tmp_path / "taken.json").write_text("mine")
    status, err = run_cli([*base, "--tasks", "[nag_local_choice]", "--output", str(tmp_path / "taken.json")],
                          capsys)
    assert status == 1 and said_once(err, "already exists")
    assert (tmp_path / "taken.json").read_text() == "mine"
    status, err = run_cli(["eval", "--ckpt_path", str(tmp_path / "none.ckpt"),
                           "--tasks", "[nag_local_choice]", "--include_path", str(TASKS)], capsys)
    assert status == 1 and said_once(err, "does not exist"), err


def test_without_lm_eval_the_command_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m.split(".")[0] == "lm_eval"] + ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: every import of it fails
    monkeypatch.delitem(sys.modules, "nag_lightning.analysis.evaluation.lm_eval_model", raising=False)
    status, err = run_cli(["eval", "--ckpt_path", str(tmp_path / "x.ckpt"), "--tasks", "[a]"], capsys)
    assert status == 1 and said_once(err, "pip install 'nag-lightning[eval]'"), err


def test_the_base_package_never_imports_lm_eval():
    code = ("import sys, nag_lightning, nag_lightning.cli, nag_lightning.checkpoints.export, "
            "nag_lightning.training.module, nag_lightning.analysis.evaluation.lm_eval_command\n"
            "from nag_lightning.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    env = {**os.environ, "PYTHONPATH": str(Path(nag_lightning.__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

