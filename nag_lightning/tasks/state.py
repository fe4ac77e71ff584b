"""State tracking: the word problem of a permutation group, k elements composed per answer.

Each episode lists k random elements of the group, then their product in order:

    D A W = K ;  Q = Q ;  B X C A H = T ;  ...
    ^ elements and '=': UNPREDICTABLE (k is drawn at random)
                  ^ product g1 g2 ... gk: difficulty k (k = 1 is a copy)   ^ ';': FORMAT

For a non-solvable group (S5, A5) no constant-depth Transformer computes the product of arbitrarily
many elements; the parallel-prefix solution needs depth growing like log k (Liu et al. 2023,
"Transformers learn shortcuts to automata", arXiv 2210.10749; Merrill, Petty & Sabharwal 2024,
"The illusion of state in state-space models", arXiv 2404.08819). Smaller groups (S3, S4, A4) are
solvable and have shortcuts, but stay sequential in practice at small width; they learn faster.

Elements are numbered in the lexicographic order of their permutations (0 is the identity) and
written as letters from 'A' when the group has at most 58 elements, else as bytes from 128.
"""

from __future__ import annotations

import itertools

import torch

from nag_lightning.tasks import FORMAT, TASKS, UNPREDICTABLE, Labelled, Task, pack

_GROUPS = ("S3", "S4", "S5", "A4", "A5")


def _elements(group: str) -> list[tuple[int, ...]]:
    """The group's permutations in lexicographic order: S_n all of them, A_n the even ones."""
    n = int(group[1:])
    perms = list(itertools.permutations(range(n)))
    if group[0] == "A":
        perms = [p for p in perms if _even(p)]
    return perms


def _even(p: tuple[int, ...]) -> bool:
    inversions = sum(p[i] > p[j] for i in range(len(p)) for j in range(i + 1, len(p)))
    return inversions % 2 == 0


def multiplication_table(group: str) -> torch.Tensor:
    """table[a, b] = index of a * b, applying a first, then b (so a product reads left to right)."""
    perms = _elements(group)
    index = {p: i for i, p in enumerate(perms)}
    return torch.tensor([[index[tuple(b[a[i]] for i in range(len(a)))] for b in perms] for a in perms])


@TASKS.register("state")
class WordProblem(Task):
    """The word problem of a permutation group: the product of k random elements.

    Args:
        group: "S3", "S4", "S5", "A4" or "A5".
        max_len: the most elements k in one product (1 to 16); each episode draws k uniformly from
            1..max_len.
    """

    def __init__(self, group: str = "S5", max_len: int = 8) -> None:
        if group not in _GROUPS:
            raise ValueError(f"state: group must be one of {', '.join(_GROUPS)}; got {group!r}.")
        if not 1 <= max_len <= 16:
            raise ValueError(f"state: max_len must be between 1 and 16; got {max_len}.")
        self.group, self.max_len = group, max_len
        self.max_difficulty = max_len
        self.table = multiplication_table(group)
        size = len(self.table)
        self.first_token = ord("A") if size <= 58 else 128

    def min_length(self) -> int:
        return self.max_len + 3

    def describe(self) -> str:
        return f"state(group={self.group}, max_len={self.max_len})"

    def sample(self, n: int, length: int, generator: torch.Generator) -> Labelled:
        size, most = len(self.table), self.max_len
        episodes = length // 4 + 1  # the shortest episode has 4 tokens: enough to fill any row
        k = torch.randint(1, most + 1, (n, episodes), generator=generator)
        g = torch.randint(size, (n, episodes, most), generator=generator)
        product = g[..., 0]
        products = [product]
        for j in range(1, most):  # products[j] = g1 ... g(j+1)
            product = self.table[product, g[..., j]]
            products.append(product)
        answer = torch.stack(products, 2).gather(2, (k - 1)[..., None])[..., 0]
        width = most + 3
        j = torch.arange(width).expand(n, episodes, width)
        kk = k[..., None]
        tokens = torch.where(j < kk, torch.cat([g, g[..., :3]], 2) + self.first_token, 0)
        tokens = torch.where(j == kk, ord("="), tokens)
        tokens = torch.where(j == kk + 1, answer[..., None] + self.first_token, tokens)
        tokens = torch.where(j == kk + 2, ord(";"), tokens)
        labels = torch.where(j == kk + 1, kk, torch.where(j == kk + 2, FORMAT, UNPREDICTABLE))
        return pack(tokens, labels, k + 3, length, self.PAD)
