"""Synthetic tasks: determinism, labels recomputed from the printed text, format by rule, speed."""

from __future__ import annotations

import time

import pytest
import torch

from nag_lightning.tasks import FORMAT, TASKS, UNPREDICTABLE, Labelled, build_task
from nag_lightning.tasks.state import _elements

SETTINGS = [("hops", {"n_nodes": 10, "max_hops": 5}), ("hops", {}), ("hops", {"n_nodes": 26, "max_hops": 13}),
            ("hops", {"n_nodes": 26, "max_hops": 13, "mix": "harmonic"}),             ("state", {"group": "S3", "max_len": 6}),
            ("state", {"group": "A5", "max_len": 8}), ("state", {})]
IDS = [f"{name}-{'-'.join(map(str, options.values())) or 'default'}" for name, options in SETTINGS]


def sample(name: str, options: dict, n: int = 16, length: int = 257, seed: int = 0) -> Labelled:
    return build_task(name, **options).sample(n, length, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "options"), SETTINGS, ids=IDS)
def test_same_seed_same_sequences_other_seed_others(name, options):
    a, b, c = (sample(name, options, seed=s) for s in (0, 0, 1))
    assert a.tokens.shape == a.difficulty.shape == (16, 257)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.difficulty, b.difficulty)
    assert not torch.equal(a.tokens, c.tokens)
    assert a.tokens.dtype == a.difficulty.dtype == torch.long
    assert 0 <= a.tokens.min() and a.tokens.max() < 256
    assert a.difficulty.min() >= UNPREDICTABLE


@pytest.mark.parametrize(("name", "options"), SETTINGS, ids=IDS)
@pytest.mark.usefixtures("one_thread")  # under contention a second spinning thread costs ~40 ms a batch
def test_generation_is_fast(name, options):
    task = build_task(name, **options)
    times = []
    for seed in range(5):
        start = time.perf_counter()
        task.sample(32, 257, torch.Generator().manual_seed(seed))
        times.append(time.perf_counter() - start)
    assert min(times) < 0.01, f"a batch of 32 x 257 took {min(times) * 1e3:.1f} ms"


def _hops_episodes(text: bytes, labels: list[int], n_nodes: int):
    """Re-parse a hops sequence: its table, then (query, hops, answer, label of answer) per query,
    checking every label on the way."""
    table = {}
    for i in range(n_nodes):
        source, target = chr(text[2 * i]), chr(text[2 * i + 1])
        assert labels[2 * i] == FORMAT and labels[2 * i + 1] == UNPREDICTABLE
        table[source] = target
    assert text[2 * n_nodes] == ord("|") and labels[2 * n_nodes] == FORMAT
    assert sorted(table) == sorted(table.values()), "the table is not a permutation"
    position, found = 2 * n_nodes + 1, []
    while position + 5 <= len(text) and text[position] != ord(" "):
        query, hops, equals, answer, end = text[position:position + 5]
        assert (chr(equals), chr(end)) == ("=", ";")
        k = int(chr(hops), 36)  # one base-36 digit: 'A' is 10 hops
        assert labels[position:position + 5] == [UNPREDICTABLE, UNPREDICTABLE, FORMAT, k, FORMAT]
        found.append((chr(query), k, chr(answer)))
        position += 5
    assert set(text[position:]) <= {ord(" ")} and set(labels[position:]) <= {FORMAT}
    return table, found


def test_hops_answers_follow_the_printed_table():
    batch = sample("hops", {"n_nodes": 10, "max_hops": 5}, n=32)
    hops_seen = set()
    for tokens, labels in zip(batch.tokens.tolist(), batch.difficulty.tolist()):
        table, queries = _hops_episodes(bytes(tokens), labels, 10)
        assert len(queries) == (257 - 21) // 5
        for letter, hops, answer in queries:
            for _ in range(hops):
                letter = table[letter]
            assert letter == answer
            hops_seen.add(hops)
    assert hops_seen == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("mix", ["uniform", "harmonic"])
def test_long_hops_need_exactly_k_steps_either_way_round(mix):
    """With 26 letters and up to 13 hops (the depth study's setting), the answer is k hops forward
    and no fewer hops forward or backward: no shorter chain reaches it."""
    batch = sample("hops", {"n_nodes": 26, "max_hops": 13, "mix": mix}, n=64, length=128)
    hops_seen = set()
    for tokens, labels in zip(batch.tokens.tolist(), batch.difficulty.tolist()):
        table, queries = _hops_episodes(bytes(tokens), labels, 26)
        inverse = {target: source for source, target in table.items()}
        for letter, hops, answer in queries:
            forward = backward = letter
            for _ in range(hops):
                assert answer not in (forward, backward), f"{hops} hops from {letter} reached sooner"
                forward, backward = table[forward], inverse[backward]
            assert forward == answer
            hops_seen.add(hops)
    assert hops_seen == set(range(1, 14))


@pytest.mark.parametrize(("mix", "share"), [("uniform", lambda k: 1 / 13),
                                             ("harmonic", lambda k: (1 / k) / sum(1 / j for j in range(1, 14)))])
def test_hop_counts_follow_the_mix(mix, share):
    labels = sample("hops", {"n_nodes": 26, "max_hops": 13, "mix": mix}, n=2000, length=128).difficulty
    answers = labels[labels >= 1]
    for k in (1, 2, 13):
        assert (answers == k).float().mean().item() == pytest.approx(share(k), rel=0.1), k


def _product(group: str, letters: bytes, first: int) -> int:
    """The product of the printed elements, composed here from the permutations themselves."""
    perms = _elements(group)
    result = tuple(range(len(perms[0])))
    for letter in letters:
        step = perms[letter - first]
        result = tuple(step[result[i]] for i in range(len(result)))  # apply result first, then step
    return perms.index(result) + first


@pytest.mark.parametrize("group", ["S3", "A5"])
def test_state_answers_are_the_products_of_the_printed_elements(group):
    task = build_task("state", group=group, max_len=6)
    batch = task.sample(16, 257, torch.Generator().manual_seed(3))
    first, lengths = task.first_token, set()
    for tokens, labels in zip(batch.tokens.tolist(), batch.difficulty.tolist()):
        text, position = bytes(tokens), 0
        while position < len(text) and text[position] != ord(" "):
            equals = text.index(b"=", position)
            k = equals - position
            assert 1 <= k <= 6 and labels[position:equals + 1] == [UNPREDICTABLE] * (k + 1)
            assert text[equals + 1] == _product(group, text[position:equals], first)
            assert labels[equals + 1] == k and text[equals + 2] == ord(";") and labels[equals + 2] == FORMAT
            lengths.add(k)
            position = equals + 3
        assert set(text[position:]) <= {ord(" ")} and set(labels[position:]) <= {FORMAT}
        assert len(text) - position < 4 + 6, "padding where another episode would have fitted"
    assert lengths == set(range(1, 7))


@pytest.mark.parametrize(("name", "options"), SETTINGS, ids=IDS)
def test_format_tokens_follow_from_the_tokens_before_them(name, options):
    """Every FORMAT token is fixed by a rule on its prefix: hops lays out every row alike, so its
    format tokens are the same in every row; in state, ';' follows an answer and padding follows
    the last ';'."""
    batch = sample(name, options, n=32)
    tokens, labels = batch.tokens, batch.difficulty
    is_format = labels == FORMAT
    if name == "hops":
        assert (is_format == is_format[0]).all()
        assert (tokens[:, is_format[0]] == tokens[0, is_format[0]]).all()
        return
    for row, mask in zip(tokens.tolist(), is_format.tolist()):
        for t in (t for t, f in enumerate(mask) if f):
            if row[t] == ord(";"):
                assert t >= 2 and row[t - 2] == ord("=")
            else:
                assert row[t] == ord(" ") and row[t - 1] in (ord(";"), ord(" "))


def test_every_registered_task_has_answers_up_to_its_hardest_level():
    for name in TASKS.names():
        task = build_task(name)
        length = max(257, task.min_length())
        labels = task.sample(64, length, torch.Generator().manual_seed(0)).difficulty
        assert set(range(1, task.max_difficulty + 1)) <= set(labels.unique().tolist()), name


def test_bad_task_options_get_one_sentence():
    with pytest.raises(ValueError, match="n_nodes must be between 2 and 26"):
        build_task("hops", n_nodes=40)
    with pytest.raises(ValueError, match=r"max_hops must be between 1 and n_nodes // 2 = 4: .* got 5"):
        build_task("hops", n_nodes=8, max_hops=5)
    with pytest.raises(ValueError, match="mix must be one of uniform, harmonic; got 'easy'"):
        build_task("hops", mix="easy")
    with pytest.raises(ValueError, match="group must be one of"):
        build_task("state", group="S9")
    with pytest.raises(ValueError, match="does not take these options"):
        build_task("hops", colour="red")
    with pytest.raises(ValueError, match="Unknown task 'nope'; registered: hops, state"):
        build_task("nope")
