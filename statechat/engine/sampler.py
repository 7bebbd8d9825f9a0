"""The sampler: a step's logits to one token per row, on the device (its logprob table is
statechat.engine.logprobs', its penalty counts statechat.engine.token_counts').

Rows that pick alike are processed together (statechat.engine.sampling.SamplingParams says how
each picks): the penalties read the device table of token counts; a draw among at most
FUSED_TOP_K candidates runs kernels.sample_top_k (logits to token in two kernels), a wider
top-k kernels.draw_candidates after torch's top-k, a draw over the vocabulary without a top-k
kernels.sample_vocabulary (four kernels, no sort), one under a top-k above CANDIDATES torch's
ops. A step's work is planned on the host (Plan), so that sampler_graphs can replay it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kernels
from statechat.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from statechat.engine.sampler_graphs import SamplerGraphs
    from statechat.engine.token_counts import TokenCounts

CANDIDATES = 1024  # a draw whose top-k is at most this samples among its top-k tokens only
TOPK_CHUNK = 4096  # a long row's top-k is taken per chunk of this many columns first
FUSED_TOP_K = 64  # a draw whose top-k are all at most this runs kernels.sample_top_k: logits
FUSED_VOCAB = 2**19  # to token in two kernels (which hold 8192 candidates per row)


@dataclass
class Rows:
    """The per-row sampling values of the rows a step processes, on the device after one copy
    of floats and one of integers: columns [R, 1] that broadcast over the vocabulary."""

    params: list[SamplingParams]
    floats: torch.Tensor  # [R, 6]: temperature, top-p (inf: off), log min-p (-inf: off),
    # repetition, frequency and presence penalties
    ints: torch.Tensor  # [R, 4]: row of the logits, counts row (0: none), top-k, whether counted

    @classmethod
    def of(cls, floats: list[list[float]], ints: list[list[int]], params,
           device: torch.device) -> Rows:
        """Rows from Plan.values() of `params`: two copies, which do not wait."""
        return cls(list(params),
                   torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True),
                   torch.tensor(ints, dtype=torch.int64).to(device, non_blocking=True))

    def slice(self, a: int, b: int) -> Rows:
        return Rows(self.params[a:b], self.floats[a:b], self.ints[a:b])

    def uses(self, name: str, off) -> bool:
        """Whether any row's `name` differs from `off`."""
        return any(getattr(p, name) != off for p in self.params)

    temperature = property(lambda self: self.floats[:, 0:1])
    top_p = property(lambda self: self.floats[:, 1:2])
    log_min_p = property(lambda self: self.floats[:, 2:3])
    logits_row = property(lambda self: self.ints[:, 0])
    counts_row = property(lambda self: self.ints[:, 1])
    top_k = property(lambda self: self.ints[:, 2:3])
    counted = property(lambda self: self.ints[:, 3].to(torch.int32))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: torch.Tensor | None = None,
    counts: tuple[TokenCounts, list[int]] | None = None,
    graphs: SamplerGraphs | None = None,
) -> torch.Tensor:
    """One token per row of logits [M, vocab] (float32), on the logits' device: the caller
    reads them all at once. `greedy`, the logits' argmax if already computed (a CUDA graph
    replays it with the model), serves the plainly greedy rows. `counts`: the TokenCounts and
    each row's row in it (0 for a request without penalties); each penalised row's new token
    is counted. `graphs`: the sampler's graphs, given when the logits (and `greedy`) lie in a
    graph's static buffers; a step they serve replays one graph instead of launching the work.

    The other rows are processed together, ordered by how they pick (an argmax of penalised
    logits, a draw among top-k candidates, a draw over the vocabulary, one under a wide top-k)
    so that each kind is one slice; a step whose rows are all of one kind copies no logits."""
    if greedy is not None and all(p.is_plain_greedy for p in params):
        return greedy
    plan = Plan.of(params, counts[1] if counts is not None else None, generators)
    if not plan.todo:
        return logits.argmax(dim=-1)
    table = counts[0] if counts is not None else None
    if graphs is not None:
        tokens = graphs.run(plan, logits, greedy, table)
        if tokens is not None:
            return tokens
    rows = Rows.of(*plan.values(), plan.params, logits.device)
    return plan.pick(logits, rows, generators, greedy, table)


@dataclass(frozen=True)
class Plan:
    """How a step's rows pick their tokens, worked out on the host before any device work.
    Its `key` holds everything the device work's shapes and branches depend on: two steps of
    one key run the same kernels on the same shapes, values aside (Rows), which is what lets
    a CUDA graph of one serve the other."""

    num_rows: int
    todo: tuple[int, ...]  # the rows that need more than the raw argmax, ordered by kind
    groups: tuple[tuple[int, int, int], ...]  # (kind, a, b): todo[a:b] pick alike
    params: tuple[SamplingParams, ...]  # of the todo rows
    counts_rows: tuple[int, ...] | None  # each todo row's row in the counts (None: no counts)
    seeded: bool  # a todo row draws from its own generator

    @classmethod
    def of(cls, params: list[SamplingParams], counts_rows: list[int] | None,
           generators: list[torch.Generator | None]) -> Plan:
        kinds = [_kind(p) for p in params]
        todo = tuple(sorted((i for i, k in enumerate(kinds) if k), key=lambda i: kinds[i]))
        groups, a = [], 0
        for kind, group in itertools.groupby(todo, key=lambda i: kinds[i]):
            groups.append((kind, a, a + len(list(group))))
            a = groups[-1][2]
        return cls(len(params), todo, tuple(groups), tuple(params[i] for i in todo),
                   None if counts_rows is None else tuple(counts_rows[i] for i in todo),
                   any(generators[i] is not None for i in todo))

    @property
    def whole(self) -> bool:
        """Every row is a todo row, in its own order: no logits are gathered."""
        return self.todo == tuple(range(self.num_rows))

    @property
    def key(self) -> tuple:
        return (self.num_rows, self.todo, self.counts_rows is not None,
                tuple((p.is_greedy, p.top_k, p.min_p > 0, p.top_p < 1, p.repetition_penalty != 1,
                       p.frequency_penalty != 0, p.presence_penalty != 0) for p in self.params))

    def values(self) -> tuple[list[list[float]], list[list[int]]]:
        """The todo rows' values that Rows carries to the device (floats, ints)."""
        rows = self.counts_rows or (0,) * len(self.todo)
        floats = [[p.temperature if not p.is_greedy else 1.0, p.top_p if p.top_p < 1 else math.inf,
                   math.log(p.min_p) if p.min_p else -math.inf, p.repetition_penalty,
                   p.frequency_penalty, p.presence_penalty] for p in self.params]
        ints = [[i, c, min(p.top_k, 2**31), int(c > 0)]
                for p, i, c in zip(self.params, self.todo, rows)]
        return floats, ints

    def pick(self, logits: torch.Tensor, rows: Rows, generators: list[torch.Generator | None],
             greedy: torch.Tensor | None, table: TokenCounts | None) -> torch.Tensor:
        """The step's tokens [M] from the logits, the todo rows' values on the device (`rows`)
        and the counts table: device work only, nothing read back (so it can be captured)."""
        vocab, picked = logits.shape[-1], []
        for kind, a, b in self.groups:
            gens, part = [generators[i] for i in self.todo[a:b]], rows.slice(a, b)
            kmax = min(max(p.top_k for p in part.params), vocab)
            if kind == CANDIDATES_KIND and kmax <= FUSED_TOP_K and vocab <= FUSED_VOCAB:
                noise = _noise((b - a, kmax), logits, gens, [p.top_k for p in part.params])
                picked.append(kernels.sample_top_k(
                    logits, part.logits_row, part.counts_row, part.floats,
                    None if table is None else table.counts,
                    None if table is None else table.in_prompt, part.ints[:, 2], noise))
                continue
            if kind == VOCABULARY_KIND and vocab <= FUSED_VOCAB:
                noise = _noise((b - a, vocab), logits, gens, [None] * (b - a))
                picked.append(kernels.sample_vocabulary(
                    logits, part.logits_row, part.counts_row, part.floats,
                    None if table is None else table.counts,
                    None if table is None else table.in_prompt, noise))
                continue
            x = kernels.penalize_logits(  # [b - a, width]: penalised, over the temperature,
                logits, part.logits_row, part.counts_row, part.floats,  # -inf padded
                None if table is None else table.counts,
                None if table is None else table.in_prompt, _padded(vocab))
            if kind == GREEDY:
                picked.append(x.argmax(dim=-1))
            elif kind == CANDIDATES_KIND:
                picked.append(_draw_candidates(x, gens, part))
            else:
                picked.append(_draw(x[:, :vocab], gens, part))
        picked = picked[0] if len(picked) == 1 else torch.cat(picked)
        if table is not None:
            table.add(rows.counts_row, picked, rows.counted)
        if self.whole:
            return picked
        out = greedy.clone() if greedy is not None else logits.argmax(dim=-1)
        return out.index_copy_(0, rows.logits_row, picked)


PLAIN, GREEDY, CANDIDATES_KIND, VOCABULARY_KIND, WIDE_KIND = 0, 1, 2, 3, 4


def _kind(p: SamplingParams) -> int:
    """How a row picks its token: PLAIN (the argmax of the raw logits), GREEDY (the argmax of
    penalised logits), a draw among its top-k candidates, one over the vocabulary (no top-k:
    kernels.sample_vocabulary), or one under a top-k too wide for candidates (torch's ops)."""
    if p.is_greedy:
        return GREEDY if p.uses_penalties else PLAIN
    if p.top_k == 0:
        return VOCABULARY_KIND
    return CANDIDATES_KIND if p.top_k <= CANDIDATES else WIDE_KIND


def _padded(vocab: int) -> int:
    """The width a chunked top-k cuts into whole chunks (top_k) without a copy."""
    return vocab if vocab <= 2 * TOPK_CHUNK else -(-vocab // TOPK_CHUNK) * TOPK_CHUNK


def _noise(shape: tuple[int, int], like: torch.Tensor, generators: list[torch.Generator | None],
           widths: list[int | None]) -> torch.Tensor:
    """Exponential(1) noise [D, n]: the draw takes the argmax of probability over noise
    (multinomial's own draw for one sample, without its checks of the probabilities, which
    read them back to the host). A seeded row's first widths[j] columns (its candidates; None:
    the whole row) come from its own generator, so its tokens do not depend on its batch;
    the kernels hand a candidate's column to it by token id, not by rank, so that holds too
    where two of its logits nearly tie and a batch's rounding swaps them."""
    noise = like.new_empty(shape).exponential_(1)
    for j, (generator, width) in enumerate(zip(generators, widths)):
        if generator is not None:
            noise[j, :width].exponential_(1, generator=generator)
    return noise


def _draw_candidates(x: torch.Tensor, generators: list[torch.Generator | None],
                     rows: Rows) -> torch.Tensor:
    """One token per row of scaled logits x [D, width] whose top-k are all at most CANDIDATES:
    drawn among each row's own top-k (kernels.draw_candidates)."""
    kmax = min(max(p.top_k for p in rows.params), x.shape[-1])
    values, cols = top_k(x, kmax)
    noise = _noise(values.shape, values, generators, [p.top_k for p in rows.params])
    return kernels.draw_candidates(values, cols, noise, rows.ints[:, 2], rows.floats)


def _draw(x: torch.Tensor, generators: list[torch.Generator | None], rows: Rows) -> torch.Tensor:
    """One token per row of scaled logits x [D, vocab] from distribution()'s probabilities
    over the whole vocabulary."""
    probs, _ = distribution(x, rows.params, rows, scaled=True)
    noise = _noise(probs.shape, probs, generators, [None] * len(generators))
    return (probs / noise).argmax(dim=-1)


def distribution(x: torch.Tensor, params: list[SamplingParams], rows: Rows | None = None,
                 scaled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The probabilities each row of logits x [D, vocab] draws from, under its temperature,
    top-k, min-p and top-p, in vLLM's order (top-p keeps the smallest set reaching its mass
    among the tokens the others kept): [D, vocab], or, when every row's top-k is at most
    CANDIDATES, [D, kmax] over each row's likeliest tokens (the rest have probability 0) with
    their token ids [D, kmax]. `rows`: the params' values on the device (made if not given);
    `scaled`: x is divided by the temperature already."""
    if rows is None:
        plan = Plan(len(params), tuple(range(len(params))), (), tuple(params), None, False)
        rows = Rows.of(*plan.values(), params, x.device)
    params = rows.params
    x = x if scaled else x / rows.temperature
    if all(_kind(p) == CANDIDATES_KIND for p in params):
        values, cols = top_k(x, min(max(p.top_k for p in params), x.shape[-1]))
        return kernels.reference.candidate_probs(values, rows.ints[:, 2], rows.floats), cols
    if rows.uses("top_k", 0):  # (top-k 0 keeps everything: its threshold is the least logit)
        kmax = min(max(p.top_k for p in params), x.shape[-1])
        values = x.topk(kmax, dim=-1).values
        kth = values.gather(1, (rows.top_k.clamp(1, kmax) - 1)).where(rows.top_k > 0, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    return kernels.reference.vocabulary_probs(x, rows.floats, rows.uses("top_p", 1)), None


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [R, V] (float32), largest first, and their columns
    ([R, k] each); equal values in column order, the lower columns taken first at the k-th
    place (kernels.reference.ranked_top_k: the kernels' order, whatever k). A long row is cut
    into chunks of TOPK_CHUNK columns whose own top-k come first: torch's topk gives each row
    one program, which leaves most of a GPU idle over a vocabulary."""
    rows, width = x.shape
    if width <= 2 * TOPK_CHUNK or k > TOPK_CHUNK:
        return kernels.reference.ranked_top_k(x, k)
    keys = kernels.reference.order_keys(x)  # (a key holds its column: no indices to follow)
    pad = -width % TOPK_CHUNK
    if pad:
        keys = torch.nn.functional.pad(keys, (0, pad), value=-(2**63))
    part = keys.view(rows, -1, TOPK_CHUNK).topk(k, dim=-1).values  # [R, chunks, k]
    cols = kernels.reference.key_columns(part.flatten(1).topk(k, dim=-1).values)
    return x.gather(1, cols), cols
