"""`nag-lightning sweep` and `nag-lightning generate` end to end, on checkpoints of tiny fits of the
debug recipe (one without a router, one per MoD router)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

from nag_lightning.analysis.evaluation.generate import generate, generate_tokens, sample_next
from nag_lightning.analysis.sweeps.sweep import run_sweep, sweep
from nag_lightning.cli import main
from nag_lightning.model import TransformerConfig
from nag_lightning.training.module import LanguageModel

DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"
ROUTERS = {
    "none": [],
    "threshold": ["--model.arch.router_options", "{target_rate: 0.25, warmup_steps: 2}"],
    "topk": ["--model.arch.router_options", "{capacity: 0.75}"],
}
LOGGER = ('{"class_path": "lightning.pytorch.loggers.CSVLogger", '
          '"init_args": {"save_dir": "runs", "name": "%s"}}')
COLUMNS = ["method", "setting", "value", "mod_rate", "flops_per_token", "executed_fraction",
           "val_loss", "bpb", "predictor_agreement", "val_batches"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mod")


@pytest.fixture(scope="module")
def checkpoints(workdir) -> dict[str, Path]:
    """One tiny fit per router, through the command's own entry point, in a scratch folder."""
    cwd = os.getcwd()
    paths = {}
    try:
        os.chdir(workdir)
        for router, options in ROUTERS.items():
            main(["fit", "--config", str(DEBUG), "--model.arch.router", router, *options,
                  "--data.cache_dir", str(workdir / "data_cache"), "--trainer.max_steps", "8",
                  "--trainer.logger", LOGGER % router, "--trainer.enable_progress_bar", "false"])
            paths[router] = workdir / "runs" / router / "version_0" / "checkpoints" / "last.ckpt"
            assert paths[router].is_file()
    finally:
        os.chdir(cwd)
    return paths


def read_rows(path: Path) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == COLUMNS
    return rows


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_attaches_and_fits_threshold_routers_to_a_model_trained_without_one(checkpoints, workdir):
    module = LanguageModel.load_from_checkpoint(checkpoints["none"], map_location="cpu")
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in module.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(6)]
    with torch.no_grad():  # the unrouted model on the same batches
        dense = torch.stack([torch.nn.functional.cross_entropy(
            module.model(b[:, :-1]).logits.flatten(0, 1), b[:, 1:].flatten()) for b in batches[:2]])
    rows = run_sweep(module, batches[:2], batches[2:], taus=[0.0, 0.05, 0.5, 3.0])

    # the frozen model's own weights are untouched; only the attached probes were fitted
    for name, value in module.model.state_dict().items():
        if ".router." not in name and torch.is_tensor(value):
            torch.testing.assert_close(value, weights[name], msg=name)
    assert all(s.router.registry_name == "threshold" for s in module.model.sublayers)

    threshold = [r for r in rows if r.method == "threshold"]
    oracle = [r for r in rows if r.method == "oracle"]
    assert [r.value for r in threshold] == [r.value for r in oracle] == [0.0, 0.05, 0.5, 3.0]
    # tau = 0 runs every token: exactly the model trained without routers
    assert threshold[0].mod_rate == 0 and oracle[0].mod_rate == 0
    assert threshold[0].val_loss == pytest.approx(dense.mean().item(), rel=1e-5)
    assert oracle[0].val_loss == pytest.approx(dense.mean().item(), rel=1e-5)
    # 3 rad is above any angle: nothing runs, and compute falls with the MoD rate
    assert threshold[-1].mod_rate == 1 and oracle[-1].mod_rate == 1
    assert threshold[-1].flops_per_token < 0.5 * threshold[0].flops_per_token
    assert threshold[0].executed_fraction == pytest.approx(1.0, abs=0.02)  # + the probes' cost


def test_sweep_command_on_a_model_trained_without_router(checkpoints, workdir, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    main(["sweep", "--ckpt_path", str(checkpoints["none"]), "--val_batches", "2", "--fit_batches", "4",
          "--cache_dir", str(workdir / "data_cache")])  # the checkpoint's own, named by the user
    out = checkpoints["none"].parents[1] / "sweep-last"  # in the run's folder, not the working one
    assert not (workdir / "sweep").exists()
    rows = read_rows(out / "sweep.csv")
    assert {r["val_batches"] for r in rows} == {"2"}
    assert {r["method"] for r in rows} == {"threshold", "oracle"}
    taus = [float(r["value"]) for r in rows if r["method"] == "threshold"]
    assert taus[0] == 0.0 and len(taus) >= 5  # chosen from the fitted probes' predictions
    rates = [float(r["mod_rate"]) for r in rows if r["method"] == "threshold"]
    assert rates[0] == 0 and max(rates) > 0.2
    assert all(float(r["bpb"]) > 0 and float(r["flops_per_token"]) > 0 for r in rows)
    assert is_png(out / "sweep.png")
    printed = capsys.readouterr().out
    assert "wrote" in printed and str(out) in printed
    lines = [line for line in printed.splitlines() if " bpb " in line]
    assert len(lines) == len(rows) and all(line.endswith("(2 val batches)") for line in lines)


def test_sweep_of_a_threshold_checkpoint(checkpoints, workdir):
    paths = sweep(str(checkpoints["threshold"]), out_dir=str(workdir / "sweep_threshold"),
                  taus=[0.0, 0.01, 0.1, 1.0], val_batches=2, cache_dir=str(workdir / "data_cache"))
    rows = read_rows(paths["csv"])
    threshold = [r for r in rows if r["method"] == "threshold"]
    assert [float(r["value"]) for r in threshold] == [0.0, 0.01, 0.1, 1.0]
    rates = [float(r["mod_rate"]) for r in threshold]
    assert rates[0] == 0 and rates[-1] == max(rates) > 0
    assert is_png(paths["png"])


def test_sweep_of_a_topk_checkpoint_reports_predictor_agreement(checkpoints, workdir):
    paths = sweep(str(checkpoints["topk"]), out_dir=str(workdir / "sweep_topk"),
                  capacities=[1.0, 0.75, 0.5], val_batches=2, cache_dir=str(workdir / "data_cache"))
    rows = read_rows(paths["csv"])
    exact = {float(r["value"]): r for r in rows if r["method"] == "topk"}
    assert float(exact[1.0]["mod_rate"]) == 0
    assert float(exact[0.5]["mod_rate"]) == pytest.approx(0.5)  # exact top-k: half of every sequence
    assert float(exact[0.75]["flops_per_token"]) < float(exact[1.0]["flops_per_token"])
    (causal,) = [r for r in rows if r["method"] == "topk_predictor"]
    assert float(causal["value"]) == 0.75
    assert 0 <= float(causal["predictor_agreement"]) <= 1
    assert all(0 <= float(r["predictor_agreement"]) <= 1 for r in exact.values())
    assert is_png(paths["png"])


@pytest.mark.parametrize("router", ["threshold", "topk"])
def test_generation_routes_each_new_byte_as_the_full_sequence_would(checkpoints, router):
    result = generate(str(checkpoints[router]), prompt="def f(x):", max_new_tokens=10)
    assert len(result.tokens) == len(result.executed) == 10
    assert result == generate(str(checkpoints[router]), prompt="def f(x):", max_new_tokens=10)

    # teacher-force the whole text: the same greedy bytes, and the same sublayers run at the
    # positions they were predicted from (routing is causal in eval mode)
    model = LanguageModel.load_from_checkpoint(checkpoints[router], map_location="cpu").model.eval()
    prompt = list(b"def f(x):")
    text = torch.tensor(prompt + result.tokens).unsqueeze(0)
    executed = []
    hooks = [s.router.register_forward_hook(
        lambda r, a, route: executed.append(torch.ones(text.shape[1], dtype=torch.bool)
                                            if route.executed is None else route.executed[0]))
        for s in model.sublayers]
    with torch.no_grad():
        logits = model(text[:, :-1]).logits[0]
    for hook in hooks:
        hook.remove()
    start = len(prompt) - 1
    assert logits[start:].argmax(-1).tolist() == result.tokens
    per_position = torch.stack(executed).sum(0)  # sublayers run at each position
    assert per_position[start:start + 10].tolist() == result.executed
    if router == "topk":  # the causal predictor routes, not the top-k of the sequence
        assert all(s.router.eval_routing == "predictor" for s in model.sublayers
                   if s.router.registry_name == "topk")


def test_generate_command_prints_the_text_and_the_executed_sublayers(checkpoints, capsysbinary):
    main(["generate", "--ckpt_path", str(checkpoints["threshold"]), "--prompt", "import ",
          "--max_new_tokens", "6", "--temperature", "0.8", "--top_k", "5", "--show_routing", "true"])
    out = capsysbinary.readouterr().out.decode("utf-8", errors="replace")  # bytes, as generated
    assert out.startswith("import ")
    assert "sublayers executed per generated byte:" in out
    assert out.count(" sublayers\n") == 6  # one routing line per generated byte


def test_generate_command_continues_a_prompt_that_is_not_utf8_byte_for_byte(checkpoints, capsysbinary):
    ckpt = str(checkpoints["none"])
    prompt = os.fsdecode(b"caf\xe9 = \xff")  # as Python reads these bytes from the command line
    result = generate(ckpt, prompt=prompt, max_new_tokens=5)
    expected = b"caf\xe9 = \xff" + result.tokenizer.decode(result.tokens)
    for stream in ("true", "false"):
        main(["generate", "--ckpt_path", ckpt, "--prompt", prompt, "--max_new_tokens", "5",
              "--stream", stream])
        out = capsysbinary.readouterr().out
        assert out.startswith(expected + b"\n"), stream
        assert b"sublayers executed per generated byte" in out


@pytest.mark.parametrize("router", list(ROUTERS))
def test_cached_generation_of_a_checkpoint_samples_as_the_uncached_reference(checkpoints, router):
    options = dict(prompt=["def f(x):", "import"], max_new_tokens=12, temperature=0.9, top_p=0.9,
                   seed=3)
    cached = generate(str(checkpoints[router]), **options)
    reference = generate(str(checkpoints[router]), cache=False, **options)
    assert [(g.tokens, g.executed) for g in cached] == [(g.tokens, g.executed) for g in reference]
    assert all(g.cache_bytes > 0 for g in cached) and reference[0].cache_bytes is None


def test_generate_command_batches_prompts_streams_one_and_runs_the_reference_on_request(
    checkpoints, capsysbinary
):
    ckpt = str(checkpoints["threshold"])

    def printed() -> str:
        return capsysbinary.readouterr().out.decode("utf-8", errors="replace")  # bytes, as generated

    main(["generate", "--ckpt_path", ckpt, "--prompt", '["ab", "import "]', "--max_new_tokens", "5"])
    out = printed()
    assert out.startswith("ab") and "\nimport " in out
    assert out.count("sublayers executed per generated byte") == 2 and out.count("KV cache:") == 2
    main(["generate", "--ckpt_path", ckpt, "--prompt", "import ", "--max_new_tokens", "5"])
    streamed = printed()
    main(["generate", "--ckpt_path", ckpt, "--prompt", "import ", "--max_new_tokens", "5",
          "--cache", "false", "--stream", "false"])
    reference = printed()
    assert streamed.splitlines()[0] == reference.splitlines()[0]
    assert "KV cache:" in streamed and "KV cache:" not in reference


def test_sampling_with_top_k_one_is_greedy_and_bad_options_are_refused():
    logits = torch.randn(256)
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=1.5, top_k=1, generator=g) == int(logits.argmax())
    model = LanguageModel(TransformerConfig(d_model=32, n_layers=1, n_heads=2, seq_len=8)).model
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_tokens(model, [], 4)
    with pytest.raises(ValueError, match="temperature >= 0"):
        generate_tokens(model, [1, 2], 4, temperature=-1.0)
    # a prompt longer than seq_len is cut to its last seq_len bytes, not refused
    tokens, executed = generate_tokens(model, list(range(20)), 3)
    assert len(tokens) == 3 and executed == [2, 2, 2]


def test_sweep_refuses_a_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--ckpt_path", str(tmp_path / "nope.ckpt")])
    assert "does not exist" in capsys.readouterr().err


def test_sweep_can_skip_on_nags_own_angle_without_a_probe(checkpoints):
    """router_options {predictor: angle}: the attached threshold routers read the gated angle NAG
    plans, have nothing to fit, and the default taus span skipping nothing to a good share."""
    module = LanguageModel.load_from_checkpoint(checkpoints["none"], map_location="cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(4)]
    rows = run_sweep(module, batches[:2], batches[2:], router_options={"predictor": "angle"})
    routers = [s.router for s in module.model.sublayers]
    assert all(r.registry_name == "threshold" and r.predictor == "angle" for r in routers)
    assert not any(p.numel() for r in routers for p in r.parameters())
    # nothing fitted, yet evaluated in eval mode: in training mode the routers would run every
    # token for their warm-up of one forward per fit batch
    assert not any(r.training for r in routers)
    threshold = [r for r in rows if r.method == "threshold"]
    assert threshold[0].value == 0.0 and threshold[0].mod_rate == 0 and len(threshold) >= 5
    assert max(r.mod_rate for r in threshold) > 0.2
    assert {r.method for r in rows} == {"threshold", "oracle"}


def test_sweep_router_options_are_checked(checkpoints):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(4)]
    unrouted = LanguageModel.load_from_checkpoint(checkpoints["none"], map_location="cpu")
    with pytest.raises(ValueError, match="router_options has 'predictr', which the router 'threshold'"):
        run_sweep(unrouted, batches[:2], batches[2:], router_options={"predictr": "angle"})
    routed = LanguageModel.load_from_checkpoint(checkpoints["threshold"], map_location="cpu")
    with pytest.raises(ValueError, match="trained with its own routers: drop router_options"):
        run_sweep(routed, batches[:2], None, router_options={"predictor": "angle"})
