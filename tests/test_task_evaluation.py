"""Evaluation by difficulty: scores per token and per level, compute per token, rank correlation,
and the tasks' promise that one block learns the format and not the hardest answers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nag_lightning.analysis.sweeps.oracle import oracle
from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.tasks import FORMAT, UNPREDICTABLE, Labelled, build_task
from nag_lightning.tasks.evaluation import (
    DifficultyScores,
    TokenScores,
    evaluate_by_difficulty,
    every_token_runs,
    level_table,
    role_table,
    score_batch,
    spearman,
    task_sequences,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(residual: str = "nag", n_layers: int = 2, **arch) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(d_model=32, n_layers=n_layers, n_heads=2, seq_len=64,
                                         residual=residual, **arch)).eval()


def hops_batch(n: int = 6, seed: int = 0) -> Labelled:
    return task_sequences("hops", {"n_nodes": 6, "max_hops": 3}, n, 49, seed)


@pytest.mark.parametrize("residual", ["nag", "prenorm", "periln"])
def test_scores_are_the_model_own_numbers_per_target(residual):
    model, batch = tiny(residual), hops_batch()
    with torch.no_grad():
        scores = score_batch(model, batch)
        logits = model(batch.tokens[:, :-1]).logits
    targets = batch.tokens[:, 1:]
    assert torch.equal(scores.difficulty, batch.difficulty[:, 1:])
    assert torch.equal(scores.correct, logits.argmax(-1) == targets)
    loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(scores.loss, loss)
    # the angle summed over sublayers, and every sublayer executed without a router
    torch.testing.assert_close(scores.angle, sum(s.contribution for s in model.sublayers).float())
    assert (scores.executed == len(model.sublayers)).all() and (scores.angle > 0).all()
    assert torch.isnan(scores.planned).all() != (residual == "nag")  # only NAG plans its angle
    assert not any(s.record for s in model.sublayers), "the recording setting was not restored"


def test_a_router_skips_show_as_fewer_executed_sublayers():
    model = tiny("nag", router="topk", router_options={"capacity": 0.5})
    scores = score_batch(model, hops_batch())
    assert scores.executed.min() < 4 and scores.executed.max() <= 4
    executed = sum(s.executed_per_seq.sum() for s in model.sublayers)
    assert scores.executed.sum() == executed
    # a skipped sublayer turns the token by nothing: the angle sums only what ran
    report = evaluate_by_difficulty(model, hops_batch())
    mod_rate = 1 - scores.executed.mean().item() / 4
    counts = sum(row["count"] for row in report.rows)
    mean_skip = sum(row["skip_rate"] * row["count"] for row in report.rows) / counts
    assert math.isclose(mean_skip, mod_rate, rel_tol=1e-5)


@pytest.mark.parametrize("router, options", [("topk", {"capacity": 0.5}),
                                             ("threshold", {"predictor": "angle", "tau": 1.0})])
def test_every_token_runs_scores_a_routed_model_at_full_depth_with_its_gates(router, options):
    model, batch = tiny("nag", router=router, router_options=options), hops_batch()
    with every_token_runs(model):
        scores = score_batch(model, batch)
        with torch.no_grad():
            logits = model(batch.tokens[:, :-1]).logits
    assert (scores.executed == len(model.sublayers)).all()
    # the same model with its routers' gates but nothing skipped: top-k writes with sigmoid(score)
    with torch.no_grad():
        state = model.strategy.init_state(model.embed(batch.tokens[:, :-1]))
        for sublayer in model.sublayers:
            h = model.strategy.read(state, sublayer.index)
            gate = torch.sigmoid(sublayer.router.score(h).squeeze(-1)) if router == "topk" else None
            f = sublayer.compute(h)
            state, _ = model.strategy.write(state, f, gate, sublayer.index, False)
        torch.testing.assert_close(logits, model.readout(state))
    assert score_batch(model, batch).executed.min() < len(model.sublayers)  # routing is back


def test_under_the_oracle_only_the_kept_writes_count():
    model = tiny("nag", router="topk", router_options={"capacity": 0.5})
    score_batch(model, hops_batch())  # leaves the routers' records behind
    with oracle(model, 10.0):  # radians: no write reaches it, so every routed sublayer is dropped
        scores = score_batch(model, hops_batch())
    assert (scores.executed == 0).all() and (scores.angle == 0).all()
    assert scores.planned.isfinite().all()


def test_the_table_groups_tokens_by_level():
    scores = TokenScores(
        difficulty=torch.tensor([[-1, 0, 0, 2, 2, 2]]),
        correct=torch.tensor([[True, True, False, True, False, False]]),
        loss=torch.tensor([[5.0, 1.0, 3.0, 2.0, 4.0, 6.0]]),
        angle=torch.tensor([[1.0, 0.5, 1.5, 2.0, 3.0, 4.0]]),
        planned=torch.full((1, 6), float("nan")),
        executed=torch.tensor([[4.0, 4.0, 2.0, 4.0, 4.0, 1.0]]),
        executed_attn=torch.tensor([[2.0, 2.0, 2.0, 2.0, 2.0, 1.0]]),
        executed_mlp=torch.tensor([[2.0, 2.0, 0.0, 2.0, 2.0, 0.0]]),
    )
    rows = {row["name"]: row for row in level_table(scores, n_sublayers=4)}
    assert list(rows) == ["unpredictable", "format", "k2"]
    assert rows["unpredictable"]["accuracy"] is None and rows["unpredictable"]["loss"] == 5.0
    assert rows["format"] == pytest.approx({"level": FORMAT, "name": "format", "count": 2, "accuracy": 0.5,
                                            "loss": 2.0, "angle": 1.0, "planned_angle": math.nan,
                                            "executed": 3.0, "skip_rate": 0.25, "skip_rate_attn": 0.0,
                                            "skip_rate_mlp": 0.5}, nan_ok=True)
    assert rows["k2"]["skip_rate_attn"] == pytest.approx(1 / 6)
    assert rows["k2"]["skip_rate_mlp"] == pytest.approx(1 / 3)
    assert rows["k2"]["accuracy"] == pytest.approx(1 / 3) and rows["k2"]["angle"] == pytest.approx(3.0)
    metric = DifficultyScores()
    metric.update(scores)
    logged = metric.compute()
    assert "unpredictable/accuracy" not in logged and "format/planned_angle" not in logged
    assert logged["k2/accuracy"].item() == pytest.approx(1 / 3) and logged["format/executed"].item() == 3.0


def test_spearman_ranks_compute_against_difficulty_over_the_answers():
    difficulty = torch.tensor([UNPREDICTABLE, FORMAT, 1, 2, 3, 4])
    tokens = TokenScores(difficulty, difficulty > 0, difficulty.float(),
                         angle=torch.tensor([9.0, 9.0, 0.1, 0.2, 0.3, 0.4]),
                         planned=torch.tensor([0.0, 0.0, 4.0, 3.0, 2.0, 1.0]), executed=torch.ones(6),
                         executed_attn=torch.ones(6), executed_mlp=torch.zeros(6))
    assert spearman(tokens, "angle") == pytest.approx(1.0)
    assert spearman(tokens, "planned") == pytest.approx(-1.0)
    assert spearman(tokens, "angle", answers_only=False) < 1.0  # the format token has the most angle
    assert math.isnan(spearman(tokens, "executed"))


def test_one_block_learns_the_format_but_not_the_hardest_answers():
    """Labels that mean what they say: after a short training, one block predicts every FORMAT
    token but a few, yet chains of 3 hops stay near chance (1/6 of the letters)."""
    task = build_task("hops", n_nodes=6, max_hops=3)
    model = tiny("prenorm", n_layers=1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(120):
        batch = task.sample(16, 49, torch.Generator().manual_seed(step)).tokens
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    rows = {row["name"]: row for row in evaluate_by_difficulty(model.eval(), task_sequences(
        "hops", {"n_nodes": 6, "max_hops": 3}, 64, 49, seed=1)).rows}
    assert rows["format"]["accuracy"] > 0.9, rows["format"]
    assert rows["k3"]["accuracy"] < 0.5, rows["k3"]


def test_evaluation_sequences_come_from_registered_tasks_only():
    with pytest.raises(ValueError, match="Unknown task 'os.system'; registered: hops, state"):
        task_sequences("os.system", {}, 2, 49, seed=0)
    assert not torch.equal(task_sequences("hops", {}, 2, 49, seed=0).tokens,
                           task_sequences("hops", {}, 2, 49, seed=1).tokens)



def test_hops_names_each_token_by_its_job_in_the_episode():
    task = build_task("hops", n_nodes=6, max_hops=3)
    labelled = task.sample(3, 60, torch.Generator().manual_seed(0))
    roles = task.roles(labelled)
    assert torch.stack(list(roles.values())).sum(0).eq(1).all()  # every token has exactly one role
    assert roles["answer"].equal(labelled.difficulty >= 1)
    assert labelled.tokens[roles["'='"]].eq(ord("=")).all()
    assert labelled.tokens[roles["';'"]].eq(ord(";")).all()
    hops = labelled.tokens[roles["hop count"]] - ord("0")
    assert ((hops >= 1) & (hops <= 3)).all()
    assert labelled.difficulty[roles["table source"]].eq(FORMAT).all()
    assert labelled.difficulty[roles["table target"] | roles["query letter"]].eq(UNPREDICTABLE).all()


def test_the_role_table_gives_skip_rates_where_each_role_is_predicted():
    difficulty = torch.tensor([[FORMAT, UNPREDICTABLE, FORMAT, 2]])
    scores = TokenScores(difficulty[:, 1:], torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3),
                         angle=torch.tensor([[1.0, 2.0, 3.0]]), planned=torch.zeros(1, 3),
                         executed=torch.tensor([[4.0, 3.0, 2.0]]),
                         executed_attn=torch.tensor([[2.0, 2.0, 2.0]]),
                         executed_mlp=torch.tensor([[2.0, 1.0, 0.0]]))
    roles = {"first": torch.tensor([[True, False, False, False]]),  # no target: not a row
             "equals": torch.tensor([[False, False, True, False]]),
             "answer": torch.tensor([[False, False, False, True]])}
    rows = {row["name"]: row for row in role_table(scores, roles, n_sublayers=4)}
    assert list(rows) == ["equals", "answer"]
    assert rows["equals"] == pytest.approx({"name": "equals", "count": 1, "angle": 2.0, "skip_rate": 0.25,
                                            "skip_rate_attn": 0.0, "skip_rate_mlp": 0.5})
    assert rows["answer"]["skip_rate_mlp"] == 1.0
