"""The stream diagnostics (docs/results_tasks.md, the diagnosis of NAG on hops) through the package's
own training: a fit on a task with the callback writes what each write did to a token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nag_lightning.callbacks.stream import diagnose
from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.tasks import build_task

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "tasks" / "debug.yaml")


def test_fit_with_the_callback_records_gradients_and_the_diagnosis(tmp_path, monkeypatch, one_thread):
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    run_lightning_cli(["fit", "--config", DEBUG, "--trainer.enable_progress_bar=false",
                       "--trainer.callbacks+=nag_lightning.callbacks.StreamDiagnostics",
                       "--trainer.callbacks.every_n_steps=2",
                       "--model.arch.residual_options={angle_cost: 0.03}"])  # priced: aux is recorded
    written = next(tmp_path.rglob("stream_diagnostics.jsonl")).read_text().splitlines()
    rows = [json.loads(line) for line in written]
    gradients = [r for r in rows if r["kind"] == "gradients"]
    validations = [r for r in rows if r["kind"] == "validation"]
    assert [r["step"] for r in gradients] == [2, 4, 6] and [r["step"] for r in validations] == [3, 6]
    assert all(len(r["sublayer"]) == 4 and len(r["gate"]) == 4 and r["aux"] > 0 for r in gradients)
    assert all(g > 0 for r in gradients for g in r["sublayer"])
    last = validations[-1]
    assert len(last["sublayers"]) == 4 and {"scale_k1", "scale_right_answer"} <= set(last["readout"])
    fields = {"angle_format", "angle_answer", "near_zero", "near_bound", "survive1_answer"}
    assert fields <= set(last["sublayers"][0])


@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_diagnose_measures_survival_and_angles_from_the_writes(residual):
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, seq_len=48,
                               residual=residual)
    model = Transformer(config)
    data = build_task("hops", n_nodes=6, max_hops=3).sample(8, 49, torch.Generator().manual_seed(1))
    model.train()
    report = diagnose(model, data.tokens, data.difficulty)
    assert model.training and not any(s.record for s in model.sublayers)  # left as it was
    rows = report["sublayers"]
    for row in rows[:-1]:  # a cosine, and an angle of at most pi
        assert -1 <= row["survive1_format"] <= 1 and 0 <= row["angle_answer"] <= torch.pi
    assert "survive1_format" not in rows[-1]  # nothing is written after the last sublayer
    assert rows[0]["survive2_answer"] <= rows[0]["survive1_answer"] + 0.2  # two writes turn it further
    if residual == "nag":
        # the gate starts at half the bound
        assert rows[0]["near_bound"] == 0.0 and rows[0]["near_zero"] == 0.0
        assert report["readout"]["scale_k0"] > 0
    else:
        assert "near_zero" not in rows[0] and report["readout"] == {}
