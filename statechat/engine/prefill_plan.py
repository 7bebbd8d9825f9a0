"""How a step's prefill tokens are shared among the prompts being prefilled: fewest tokens left
first, so a short prompt is not kept waiting for a long one's whole prefill (vLLM's
`long_prefill_token_threshold` and `max_long_partial_prefills` let short prompts jump the queue
too; here the order is by tokens left, with no threshold to tune), and the oldest prompt in
flight is reserved a chunk whenever the step has room for one, so that no stream of shorter
prompts starves it. Its reserve is one block (or its last chunk) while the fill gives it that
much, and doubles each step in a row that the fill left it less, up to half the step's share
(whole blocks, at least one), while the KV blocks free hold every prompt in flight to its end
(else one gives way for blocks whatever the plan, and the fill frees them soonest: prompts of
14,000 and 13,000 tokens in a cache of 19,200 grew side by side until the newer gave way with
10,304 tokens computed, 38 steps rather than 27). While the shorter prompts leave it a block a
step it is never raised, and under overload the oldest takes half of each step's share after
five doublings (from a share of 4,096), not a block a step, at the cost of the short prompts
behind it, whose tokens must wait for its own. In a simulation with 4,500 tokens of 300-token
prompts arriving a step for a budget of 4,096 and a 6,000-token prompt every 20 steps, the long
ones got a block a step and none had its first token within 160 steps; now each has it at most 7
steps after its admission (21 after its arrival), and the short ones' first tokens come 9.3
steps after theirs on average (at most 18) rather than 6.0 (12). Under 12 such prompts a step
(3,600 tokens) nothing changes: each short one's first token comes in its arrival step
(tests/engine/test_scheduler_overload.py). Once it is done the next oldest is guaranteed so, and
so on: every admitted prompt finishes.

Plain arithmetic over sequences: nothing is allocated here (but for `note_starved`, which
counts the oldest's steps starved on it, told the blocks free). Scheduler.schedule plans a step
with `plan_prefills`, then asks for the chunks' blocks in admission order (so that when blocks
run out the newest sequence is still the one that gives way).
"""

from __future__ import annotations

from statechat.engine.sequence import Sequence


def chunk_len(seq: Sequence, limit: int, block_size: int) -> int:
    """Tokens of the next prefill chunk of `seq` of at most `limit` tokens: it ends on a block
    boundary unless it ends the sequence's tokens (0: no such chunk fits in `limit`)."""
    if limit <= 0:
        return 0
    start = seq.num_computed
    end = start + min(seq.num_uncomputed, limit)
    if end < len(seq):
        end = end // block_size * block_size
    return max(end - start, 0)


def blocks_needed(seqs: list[Sequence], sizes: list[int], block_size: int) -> int:
    """KV blocks that chunks of `sizes` tokens of `seqs` need beyond those they hold."""
    return sum(max(-(-(s.num_computed + n) // block_size) - len(s.block_table), 0)
               for s, n in zip(seqs, sizes) if n)


def plan_prefills(seqs: list[Sequence], share: int, budget: int, block_size: int) -> list[int]:
    """Prefill tokens for each of `seqs` (prompts being prefilled, oldest first) in a step that
    may spend `share` tokens on prefills (its time target's cap, or all of `budget`) and no
    more than `budget` (the step's token budget left after its decodes).

    Prompts with fewer tokens left go first (ties: the older first), each taking its chunk
    (whole blocks, a prompt's last chunk excepted) of what is left of `share`. If that leaves
    the oldest prompt less than its reserve (`reserve`), it gets its reserve first and the
    others share the rest of `share` after it; a share of a single block (a step cut to its
    time target on a slow machine) is theirs whole, so such a step may take two blocks."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_uncomputed)  # (stable)
    sizes = _fill(seqs, order, [0] * len(seqs), share, block_size)
    first = reserve(seqs[0], share, budget, block_size) if seqs else 0
    if sizes and sizes[0] < first:
        # its reserve comes out of the share, but for a share of one block: then the others
        # keep theirs (else a short prompt would wait for the long one's whole prefill)
        others = min(max(share - first, min(share, block_size)), budget - first)
        sizes = [first] + [0] * (len(seqs) - 1)
        sizes = _fill(seqs, [i for i in order if i], sizes, first + others, block_size)
    return sizes


def reserve(seq: Sequence, share: int, budget: int, block_size: int) -> int:
    """The chunk that `seq`, the oldest prompt in flight, is sure of in a step of `share`
    prefill tokens (and `budget`): one block, doubled for each step in a row that the fill left
    it less (`steps_starved`), up to half the share in whole blocks (at least one); its last
    chunk where that is less."""
    half = max(share // 2 // block_size * block_size, block_size)
    tokens = min(block_size << min(seq.steps_starved, 32), half, budget)
    return chunk_len(seq, tokens, block_size)


def note_starved(seqs: list[Sequence], sizes: list[int], share: int, block_size: int,
                 free_blocks: int) -> None:
    """After the step's plan (`sizes` for `seqs`, oldest first, of `share` tokens): the oldest
    counts one more step starved if the plan raised its chunk to its reserve (the fill left it
    less), or none once the fill gives it that much; its reserve doubles per step counted. But
    it counts none while the `free_blocks` KV blocks free do not hold every prompt in flight to
    its end: then one of them will give way for blocks, and the fill, letting the fewest tokens
    left finish first, frees them soonest (a reserve that grew kept a long prompt's blocks
    growing beside another's, until the newer gave way, its prefill computed again)."""
    if not seqs:
        return
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_uncomputed)
    filled = _fill(seqs, order, [0] * len(seqs), share, block_size)[0]
    wanted = sum(max(-(-len(s) // block_size) - len(s.block_table), 0) for s in seqs)
    starved = filled < sizes[0] and wanted <= free_blocks
    seqs[0].steps_starved = seqs[0].steps_starved + 1 if starved else 0


def _fill(seqs: list[Sequence], order: list[int], sizes: list[int], limit: int,
          block_size: int) -> list[int]:
    """Give each of `seqs` in `order` its chunk of what `sizes` leave of `limit` tokens."""
    used = sum(sizes)
    for i in order:
        sizes[i] = chunk_len(seqs[i], limit - used, block_size)
        used += sizes[i]
    return sizes


def awaits_prefix(head: Sequence, seqs: list[Sequence], block_size: int, interval: int) -> bool:
    """Whether waiting `head` shares a prefix with one of `seqs` (prompts being prefilled) past
    a boundary where that one will leave a checkpoint (its prompt's last, or a multiple of
    `interval` blocks) and has not computed yet: admitted once it has, `head` resumes there;
    admitted now, it would compute that prefix a second time beside it (reuse is decided at
    admission)."""
    hashes = head.block_hashes[: (len(head) - 1) // block_size]  # (what its reuse may take)
    for seq in seqs:
        shared, done = _shared_blocks(hashes, seq.block_hashes), seq.num_computed // block_size
        last = (seq.num_prompt_tokens - 1) // block_size
        if done < last <= shared or (interval and done < shared // interval * interval):
            return True
    return False


def _shared_blocks(a: list[bytes], b: list[bytes]) -> int:
    """Leading blocks two chains of block hashes share (a chained hash names its whole prefix,
    so a match at block k means all before it match too)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[mid - 1] == b[mid - 1] else (lo, mid - 1)
    return lo
