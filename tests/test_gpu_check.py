"""benchmarks/gpu_check.py: its CPU dry run writes every section with a status, as a GPU run would;
a section that fails or lacks an optional package is recorded and the others still run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATUSES = {"ok", "skipped", "error"}


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    return gpu_check


def test_dry_run_writes_every_section_with_a_status(tmp_path, gpu_check):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # One recipe, a child process (FSDP2's recipe runs the same way; tests/test_fsdp2.py trains it).
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path),
         "--recipes", "gpu_bf16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    assert all(s["status"] in STATUSES for s in sections.values())
    # Everything the sections need is installed here, so in the dry run every one of them runs.
    failed = {name: s.get("reason") for name, s in sections.items() if s["status"] != "ok"}
    assert not failed, failed
    assert sections["kernels"]["goal_met"]  # the interpreted kernel matches the reference
    assert {r["dtype"] for r in sections["kernels"]["results"]} == {"fp32", "bf16"}
    assert {c["pass"] for c in sections["bandwidth"]["results"]["calls"]} == {"fwd", "fwd+bwd"}
    assert set(sections["residual_step"]["results"]) == {"prenorm", "nag"}
    mod = sections["mod_step"]["results"]
    assert mod["unrouted"]["mod_rate"] == 0 and 0 < mod["topk 25%"]["mod_rate"] < 1
    assert 0 < mod["mlp 50%"]["mod_rate"] <= 0.5  # the recommended setting skips MLPs only
    assert all(row["decode"]["ms_per_token"] > 0 for row in mod.values())  # generation timed too
    assert mod["unrouted"]["decode"]["mod_rate"] == 0
    assert sections["activation_checkpointing"]["results"]["with"]["memory_ratio"] < 1
    assert {r["status"] for r in sections["recipes"]["results"].values()} == {"ok"}
    assert set(sections["recipes"]["results"]) == {"gpu_bf16"}
    assert {"prenorm compiled", "nag compiled", "mlp 50% compiled"} <= set(sections["compile"]["results"]["steps"])
    assert report["meta"]["dry_run"] is True
    summary = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | ok |" in summary for name in sections)


def test_a_failing_section_and_missing_packages_are_recorded(tmp_path, gpu_check, monkeypatch):
    real_find_spec = importlib.util.find_spec
    missing = ("litdata", "jsonargparse")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real_find_spec(name, *a))

    def broken(check):
        raise RuntimeError("the kernel launch failed")

    monkeypatch.setitem(gpu_check.SECTIONS, "kernels", broken)
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--sections", "kernels", "recipes",
                             "activation_checkpointing"])
    assert status == 0
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["kernels"]["status"] == "error"
    assert "RuntimeError: the kernel launch failed" in sections["kernels"]["reason"]
    assert sections["recipes"]["status"] == "skipped"
    assert "jsonargparse and litdata not installed" in sections["recipes"]["reason"]
    assert sections["activation_checkpointing"]["status"] == "ok"  # ran after both
    assert "the kernel launch failed" in (tmp_path / "gpu_check.md").read_text()


def test_without_a_gpu_it_says_so_in_one_sentence(tmp_path, gpu_check, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_check: error: no CUDA device") and err.count("\n") == 0
    assert not (tmp_path / "gpu_check.json").exists()
