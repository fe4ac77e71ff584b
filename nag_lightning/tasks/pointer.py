"""k-hop pointer chasing: follow a random cyclic permutation k times, k mixed within a sequence.

Each sequence opens with the table of a fresh cyclic permutation f of `n_nodes` letters, sources in order,
then asks queries until the sequence is full:

    aqbfcz...pd|c3=x;k1=m;f7=b;...   (n_nodes pairs, '|', then queries of 5 tokens each)
    ^ sources: FORMAT     ^ query letter and hop count: UNPREDICTABLE
     ^ targets: UNPREDICTABLE   '=', ';': FORMAT; the answer f^k(query): difficulty k

Following k pointers needs k sequential look-ups; a Transformer can do them by doubling
(f, f^2, f^4, ...), so the depth it needs grows like log k, and no fixed depth suffices for all k
(Sanford, Hsu & Telgarsky 2024, "Transformers, parallel computation, and logarithmic depth",
arXiv 2402.09268). f is one cycle through all the letters, so for k < n_nodes the answer is never
the query itself and is uniform over the other letters: a permutation with short cycles would
return to the query after a few hops, a guess a shallow model learns (f^4(x) = x for every letter
on a cycle of length 1, 2 or 4), and any other function collapses chains onto its fixed points.
On a cycle of n letters k hops forward land where n - k hops backward do, and a backward hop is
one look-up as well (find x among the targets, read its source), so hop counts stay at most
n_nodes / 2: no shorter chain, either way round, reaches the answer. Hop counts above 9 are written
as one base-36 digit ('A' is 10), so every query keeps its five tokens.

The hop counts of a sequence are a curriculum in one mix: k hops can only be learned once k - 1
can. `mix: harmonic` draws k with probability proportional to 1/k, so that with many levels the
easy ones, which every harder one waits for, still get most of the answers of a batch.
"""

from __future__ import annotations

import torch

from nag_lightning.tasks import FORMAT, TASKS, UNPREDICTABLE, Labelled, Task

_QUERY = 5  # letter, hop count, '=', answer, ';'
_HOP_DIGITS = torch.tensor([ord(c) for c in "0123456789ABCD"])  # k hops print as _HOP_DIGITS[k]
MIXES = ("uniform", "harmonic")


@TASKS.register("hops")
class PointerChasing(Task):
    """k-hop pointer chasing over a random cyclic permutation.

    Args:
        n_nodes: letters in the permutation (2 to 26).
        max_hops: the largest hop count k asked (1 to n_nodes // 2, so at most 13); every query
            draws k from 1..max_hops, as `mix` says.
        mix: how often each hop count is asked: "uniform" (equally often) or "harmonic"
            (probability proportional to 1/k).
    """

    def __init__(self, n_nodes: int = 16, max_hops: int = 8, mix: str = "uniform") -> None:
        if not 2 <= n_nodes <= 26:
            raise ValueError(f"hops: n_nodes must be between 2 and 26 (one letter each); got {n_nodes}.")
        if not 1 <= max_hops <= n_nodes // 2:
            raise ValueError(
                f"hops: max_hops must be between 1 and n_nodes // 2 = {n_nodes // 2}: on a cycle of "
                f"{n_nodes} letters, k hops forward are {n_nodes} - k hops backward, so a larger count is "
                f"not harder; got {max_hops}. Raise n_nodes (up to 26) or lower max_hops."
            )
        if mix not in MIXES:
            raise ValueError(f"hops: mix must be one of {', '.join(MIXES)}; got {mix!r}.")
        self.n_nodes, self.max_hops, self.mix = n_nodes, max_hops, mix
        self.max_difficulty = max_hops

    def min_length(self) -> int:
        return 2 * self.n_nodes + 1 + _QUERY

    def describe(self) -> str:
        mix = "" if self.mix == "uniform" else f", mix={self.mix}"
        return f"hops(n_nodes={self.n_nodes}, max_hops={self.max_hops}{mix})"

    def sample(self, n: int, length: int, generator: torch.Generator) -> Labelled:
        nodes = self.n_nodes
        order = torch.rand(n, nodes, generator=generator).argsort(1)  # the cycle's order, per row
        perm = torch.empty_like(order).scatter_(1, order, order.roll(-1, 1))  # f(order[i]) = order[i+1]
        a = ord("a")
        table = torch.stack([torch.arange(nodes).expand(n, nodes), perm], 2).flatten(1) + a
        table_labels = torch.tensor([FORMAT, UNPREDICTABLE]).repeat(nodes).expand(n, -1)
        queries = max((length - 2 * nodes - 1) // _QUERY, 0)
        start = torch.randint(nodes, (n, queries), generator=generator)
        hops = self._hop_counts(n, queries, generator)
        answer = start.clone()
        for step in range(1, self.max_hops + 1):  # answer = f^hops(start), one hop at a time
            moved = perm.gather(1, answer)
            answer = torch.where(hops >= step, moved, answer)
        query = torch.stack([
            start + a, _HOP_DIGITS[hops], torch.full_like(start, ord("=")), answer + a,
            torch.full_like(start, ord(";")),
        ], 2)
        query_labels = torch.stack([
            torch.full_like(start, UNPREDICTABLE), torch.full_like(start, UNPREDICTABLE),
            torch.full_like(start, FORMAT), hops, torch.full_like(start, FORMAT),
        ], 2)
        bar = torch.full((n, 1), ord("|"))
        tokens = torch.cat([table, bar, query.flatten(1)], 1)
        labels = torch.cat([table_labels, torch.full((n, 1), FORMAT), query_labels.flatten(1)], 1)
        pad = length - tokens.shape[1]
        tokens = torch.cat([tokens, torch.full((n, pad), self.PAD)], 1)[:, :length]
        labels = torch.cat([labels, torch.full((n, pad), FORMAT)], 1)[:, :length]
        return Labelled(tokens, labels)

    def _hop_counts(self, n: int, queries: int, generator: torch.Generator) -> torch.Tensor:
        """(n, queries) hop counts in 1..max_hops, drawn as `mix` says."""
        if self.mix == "uniform" or n * queries == 0:
            return torch.randint(1, self.max_hops + 1, (n, queries), generator=generator)
        weights = 1 / torch.arange(1, self.max_hops + 1, dtype=torch.float).expand(n, -1)
        return torch.multinomial(weights, queries, replacement=True, generator=generator) + 1

    QUERY_ROLES = ("query letter", "hop count", "'='", "answer", "';'")

    def roles(self, labelled: Labelled) -> dict[str, torch.Tensor]:
        """Table sources and targets, the '|', the five tokens of a query, and padding, by position."""
        n, length = labelled.tokens.shape
        position = torch.arange(length).expand(n, -1)
        table = 2 * self.n_nodes
        in_query = (position - table - 1) % _QUERY
        query = (position > table) & (labelled.tokens != self.PAD)
        roles = {"table source": (position < table) & (position % 2 == 0),
                 "table target": (position < table) & (position % 2 == 1), "'|'": position == table}
        roles.update({name: query & (in_query == i) for i, name in enumerate(self.QUERY_ROLES)})
        roles["padding"] = (position > table) & (labelled.tokens == self.PAD)
        return roles
