"""Warm-up at start: compile, before any request, the kernels a step can first need while
other requests run (Triton builds a kernel on its first call; its disk cache serves later
processes), by running the runner's model and sampler on padding that touches nothing real.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

import kernels
from kernels import CHUNK
from statechat.devices import accelerator
from statechat.engine.logprobs import logprob_table
from statechat.engine.sampler import sample
from statechat.engine.sampling import SamplingParams
from statechat.engine.token_counts import TokenCounts
from statechat.model.context import Context

if TYPE_CHECKING:
    from statechat.engine.runner import ModelRunner

log = logging.getLogger("statechat.engine")


def warm_up(runner: ModelRunner, max_seqs: int, max_tokens: int, max_blocks: int = 1) -> None:
    """Compile, before any request, the kernels a step can first need while others run:
    the GDN slot copy (a decode step's checkpoint at a block boundary: its first call took
    0.44 s on an H100, stalling every running request); eager forwards of several
    sequences (a step that prefills more than one, or mixes prefills and decodes), one for
    each tile the GDN state kernel takes by the number of sequences, and without prefill
    graphs one of a step's most tokens (the conv's and GDN prepare kernel's launch for
    large steps; with graphs the largest one's capture builds it) and one chunk over a
    context of each width that takes another form of the attention's key splits, and
    without decode graphs eager decode steps (one sequence: the one-row GEMVs, at each such
    width; two: the unfused path); the
    sampler's draws over the vocabulary and among a top-k, with and without penalties,
    first in a step or after another group (its values' pointer is then aligned otherwise:
    other builds), and among a top-k of 33-64 (another merge tile: top-k 40 is llama.cpp's
    default); a penalised argmax; the logprob and prompt-score tables (one build for every
    k up to 32: kernels.sampler._merge_sizes). Triton compiles a kernel on its first call;
    its disk cache serves later processes. Not built here: a top-k above 64, a logprob k
    above 32. max_seqs, max_tokens: the engine's sequences and tokens a step; max_blocks:
    the widest block table (the context limit in blocks)."""
    runner.copy_slots([(0, runner.pad_slot)])  # (slot 0's zeros into the pad slot: harmless)
    _warm_forwards(runner, _forward_shapes(runner, max_seqs, max_tokens, max_blocks))
    _warm_sampler(runner)


def _forward_shapes(runner: ModelRunner, max_seqs: int, max_tokens: int, max_blocks: int
                    ) -> list[tuple[int, int, int]]:
    """The (sequences, tokens each, blocks of context) of the eager forwards warm_up runs: one
    per GDN state tile, and the large step, chunks and decode steps that no graph's capture
    builds (see warm_up)."""
    from kernels.attention import split_widths  # (imports triton: accelerators only)
    from kernels.gdn_chunk import state_tile_counts

    mc, most = runner.loaded.config, min(max_seqs, max_tokens // CHUNK)
    heads, width = mc.linear_num_value_heads, mc.linear_value_head_dim
    shapes = [(n, CHUNK, 1) for n in state_tile_counts(heads, width, runner.device, most)]
    kv = runner.caches.k[0] if runner.caches.k else None  # [blocks, block_size, Hkv, D]

    def widths(tokens: int) -> list[int]:  # where a step of `tokens` takes each attention form
        if kv is None:
            return [1]
        q = torch.empty(tokens, mc.num_attention_heads, kv.shape[3], dtype=runner.dtype,
                        device=runner.device)
        return split_widths(q, kv.shape[2], max_blocks)

    if runner.prefill_graphs is None:  # (else the graphs' captures built these)
        shapes.append((1, max_tokens // CHUNK * CHUNK, 1))  # the tiles chosen by tokens
        shapes += [(1, CHUNK, w) for w in widths(CHUNK)[1:]]  # a chunk over a longer context
    if runner.graphs is None:
        shapes += [(1, 1, w) for w in widths(1)] + [(min(2, max_seqs), 1, 1)]
    return shapes


def _warm_forwards(runner: ModelRunner, shapes: list[tuple[int, int, int]]) -> None:
    """warm_forward each of `shapes` in turn; the first that runs out of memory is said in a
    warning and ends the run (the later ones are no smaller)."""
    for n, length, blocks in shapes:
        try:
            warm_forward(runner, n, length, blocks)
        except torch.OutOfMemoryError:
            if runner.device.type != "cpu":
                accelerator(runner.device).empty_cache()
            log.warning("statechat: no memory for an eager step of %d tokens at start; "
                        "a step that large may fail while serving (EngineConfig: "
                        "lower memory_fraction or max_num_batched_tokens)", n * length)
            break


def _warm_sampler(runner: ModelRunner) -> None:
    """Draw over zero logits as warm_up lists: top-p, top-k 20 and 40, each alone, penalised,
    and after a penalised row; two groups in one step; a penalised argmax; then the logprob
    and prompt-score tables."""
    vocab = runner.loaded.config.vocab_size
    logits = torch.zeros(2, vocab, dtype=torch.float32, device=runner.device)
    counts = TokenCounts(vocab, runner.device)
    row = counts.row(-1, [0], [])
    top_p, top_k = (SamplingParams(temperature=1.0, top_p=0.9),
                    SamplingParams(temperature=1.0, top_k=20))
    wider = SamplingParams(temperature=1.0, top_k=40)  # (llama.cpp's and Ollama's default)
    penalised = SamplingParams(presence_penalty=1.0)
    for params in (top_p, top_k, wider):
        sample(logits[:1], [params], [None])
        sample(logits[:1], [dataclasses.replace(params, presence_penalty=1.0)], [None],
               counts=(counts, [row]))
        sample(logits, [penalised, params], [None] * 2, counts=(counts, [row, row]))
    sample(logits, [top_k, top_p], [None] * 2)
    tokens = sample(logits[:1], [penalised], [None], counts=(counts, [row]))
    logits = logits[:1]
    logprob_table(logits, tokens, [0], 5)
    kernels.score_logits(logits.to(runner.dtype), tokens, 5)  # (prompt logprobs: model dtype)


def warm_forward(runner: ModelRunner, n: int, length: int = CHUNK, width: int = 1) -> None:
    """One eager forward over n padding sequences of `length` new tokens (one: a decode
    step; else a multiple of CHUNK, with a checkpoint at the end) at the end of a context of
    `width` blocks at the least: states from the zero slot into the pad slot, no KV written
    (block 0 read for every block). Kernels do not specialise on counts, but some choose
    their launch by size: the GDN state kernel its tile by the number of sequences, the
    conv and the GDN prepare kernel theirs by the tokens, the attention its key splits by
    the width, and a decode step of one sequence takes the one-row GEMVs."""
    dev, i32, i64 = runner.device, torch.int32, torch.int64
    blocks = max(width, -(-length // runner.block_size))
    context = blocks * runner.block_size
    cu = torch.arange(0, n * length + 1, length, dtype=i32, device=dev)
    pad = torch.full((n,), runner.pad_slot, dtype=i32, device=dev)
    checkpoints = None if length == 1 else kernels.Checkpoints(
        torch.arange(n, dtype=i32, device=dev), torch.full((n,), length, dtype=i32, device=dev),
        pad)
    ctx = Context(
        positions=torch.arange(context - length, context, dtype=i64, device=dev).repeat(n),
        cu_seqlens=cu, is_decode=length == 1, state_src=torch.zeros(n, dtype=i32, device=dev),
        state_dst=pad, slot_mapping=torch.full((n * length,), -1, dtype=i64, device=dev),
        block_tables=torch.zeros(n, blocks, dtype=i32, device=dev),
        context_lens=torch.full((n,), context, dtype=i32, device=dev),
        checkpoints=checkpoints, logits_indices=(cu[1:] - 1).to(i64),
        logits_seqs=None if length == 1 else torch.arange(n, dtype=i64, device=dev),
        rope_table=runner.rope_table,
    )
    runner.model(torch.zeros(n * length, dtype=i64, device=dev), ctx, runner.caches)
