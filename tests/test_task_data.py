"""Task data: seeded batches, a stateful loader that resumes exactly, labelled files, and `fit`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nag_lightning.tasks import FORMAT, UNPREDICTABLE, Labelled
from nag_lightning.tasks.datamodule import FILE_PAD, Batches, TaskDataModule, read_labelled
from tests.helpers import run_command

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "recipes" / "tasks" / "debug.yaml")
HOPS = {"n_nodes": 8, "max_hops": 4}


def data(**options) -> TaskDataModule:
    return TaskDataModule(**{"seq_len": 64, "batch_size": 4, "val_sequences": 10, "task_options": HOPS,
                             **options})


def test_training_batch_i_depends_on_the_seed_and_i_alone():
    first = list(zip(range(3), data().train_dataloader()))
    again = list(zip(range(3), data().train_dataloader()))
    other = list(zip(range(3), data(seed=7).train_dataloader()))
    for (_, a), (_, b), (_, c) in zip(first, again, other):
        assert a.shape == (4, 65) and a.dtype == torch.long
        assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(first[0][1], first[1][1])


def test_validation_is_labelled_and_from_its_own_stream():
    module = data()
    val = list(module.val_dataloader())
    assert [len(b.tokens) for b in val] == [4, 4, 2] and all(isinstance(b, Labelled) for b in val)
    assert val[0].difficulty.shape == (4, 65) and val[0].difficulty.max() == 4
    train = torch.cat([b for _, b in zip(range(50), module.train_dataloader())])
    assert not (train[:, None] == val[0].tokens[None]).all(-1).any(), "a validation row was trained on"
    assert [torch.equal(a.tokens, b.tokens) for a, b in zip(val, data().val_dataloader())] == [True] * 3
    assert all(torch.equal(a.tokens, b) for a, b in zip(val, module.test_dataloader()))


def test_each_rank_validates_on_its_own_share():
    sequences = Labelled(torch.arange(10)[:, None].repeat(1, 3), torch.zeros(10, 3, dtype=torch.long))
    shares = [[b.tokens[:, 0].tolist() for b in Batches(sequences, 2, rank, 2)] for rank in (0, 1)]
    assert shares == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]


def test_the_loader_resumes_from_its_state_where_it_stopped():
    loader = data(epoch_batches=3).train_dataloader()
    straight = list(loader) + list(loader)  # two epochs
    assert len(straight) == 6 and loader.state_dict() == {"index": 6}
    stopped = data(epoch_batches=3).train_dataloader()
    for _ in zip(range(2), stopped):
        pass
    resumed = data(epoch_batches=3).train_dataloader()
    resumed.load_state_dict(stopped.state_dict())
    rest = list(resumed)  # the rest of the interrupted epoch, then the next one
    assert len(rest) == 1 and torch.equal(rest[0], straight[2])
    assert torch.equal(next(iter(resumed)), straight[3])
    with pytest.raises(ValueError, match="holds no batch index"):
        resumed.load_state_dict({"index": "3"})


def test_a_sequence_too_short_for_an_episode_is_refused():
    with pytest.raises(ValueError, match="cannot hold one episode"):
        data(seq_len=16)


def write_lines(path: Path, *entries) -> Path:
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def test_a_labelled_file_is_read_and_padded(tmp_path):
    file = write_lines(tmp_path / "mine.jsonl", {"text": "ab=é", "difficulty": [-1, -1, 0, 2, 2]}, "",
                       {"tokens": [1, 2, 3], "difficulty": [0, 1, 0]})
    read = read_labelled(file, 8)
    assert read.tokens.tolist() == [[97, 98, 61, 195, 169] + [FILE_PAD] * 3, [1, 2, 3] + [FILE_PAD] * 5]
    assert read.difficulty.tolist() == [[-1, -1, 0, 2, 2] + [UNPREDICTABLE] * 3, [0, 1, 0] + [-1] * 5]


@pytest.mark.parametrize(("entries", "message"), [
    ([{"text": "abc", "difficulty": [0, 1]}],
     r"line 1 has 3 bytes of text \(UTF-8\) but 2 difficulty labels"),
    ([{"tokens": [1, 2], "difficulty": [0, -2]}], "line 1 has a difficulty label below -1"),
    ([{"tokens": [1, 2], "difficulty": [0, 0]}, {"tokens": [1, 256], "difficulty": [0, 0]}],
     "line 2: \"tokens\" must be a list of token ids from 0 to 255"),
    ([], "holds no labelled sequences"),
    (["{not json"], "line 1 is not JSON"),
    ([{"text": "ab"}], "needs \"difficulty\" and exactly one of"),
    ([{"text": "a" * 20, "difficulty": [0] * 20}], "line 1 has 20 tokens; .* split it or raise data.seq_len"),
])
def test_a_bad_labelled_file_gets_one_sentence(tmp_path, entries, message):
    file = write_lines(tmp_path / "bad.jsonl", *entries)
    with pytest.raises(ValueError, match=message) as error:
        read_labelled(file, 8)
    assert len(str(error.value).splitlines()) == 1


def test_a_file_replaces_the_task_its_last_lines_validate(tmp_path):
    lines = [{"tokens": [i, i, 0], "difficulty": [-1, 1, FORMAT]} for i in range(12)]
    file = write_lines(tmp_path / "mine.jsonl", *lines)
    module = data(file=str(file), seq_len=4, val_sequences=3, batch_size=8)
    assert module.max_difficulty == 1
    assert torch.cat([b.tokens for b in module.val_dataloader()])[:, 0].tolist() == [9, 10, 11]
    trained = torch.cat([b for _, b in zip(range(20), module.train_dataloader())])[:, 0]
    assert set(trained.tolist()) == set(range(9))
    with pytest.raises(ValueError, match="holds 12 sequences, not more than data.val_sequences=12"):
        data(file=str(file), seq_len=4, val_sequences=12)


def fit_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", DEBUG, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=6",
            "--checkpoint.every_n_train_steps=2", "--checkpoint.save_top_k=-1", "--checkpoint.monitor=null",
            f"--checkpoint.dirpath={tmp_path / 'ckpt'}", "--checkpoint.filename=step{step}", *extra]


def test_fit_on_task_data_logs_scores_per_level_and_resumes_exactly(tmp_path, monkeypatch, one_thread):
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    straight = run_lightning_cli(fit_args(tmp_path / "a"))
    metrics = (next((tmp_path / "runs").rglob("metrics.csv"))).read_text().splitlines()[0].split(",")
    for level in ("format", "k1", "k3"):
        assert f"val/difficulty/{level}/accuracy" in metrics and f"val/difficulty/{level}/angle" in metrics
    assert "val/difficulty/unpredictable/loss" in metrics and "val/bpb" in metrics
    assert "val/difficulty/unpredictable/accuracy" not in metrics
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_lightning_cli(fit_args(tmp_path / "b", "--trainer.callbacks+=tests.test_cli.StopAfter",
                                   "--trainer.callbacks.step=3"))
    checkpoint = tmp_path / "b" / "ckpt" / "step2.ckpt"
    resumed = run_lightning_cli(fit_args(tmp_path / "b", f"--ckpt_path={checkpoint}"))
    assert resumed.trainer.global_step == straight.trainer.global_step == 6
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    for name in (name for name, value in a.items() if torch.is_tensor(value)):
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_text_data_stays_the_default_and_task_options_are_checked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, printed, err = run_command(["fit", "--config", str(ROOT / "recipes" / "debug.yaml"),
                                        "--data.source=corpus.txt", "--print_config"], capsys)
    assert status == 0, err
    assert "class_path: nag_lightning.TextDataModule" in printed and "source: corpus.txt" in printed
    status, _, err = run_command(["fit", "--config", DEBUG, "--data.task_options={n_nodes: 40}"], capsys)
    assert status == 1 and "Traceback" not in err
    assert re.search(r"error: hops: n_nodes must be between 2 and 26", err), err[-2000:]
