"""The static inputs of the prefill graphs (prefill_graphs.py): a padded layout of up to k
prompt chunks in a token bucket, staged through pinned host memory into device buffers that
every graph reads.

Layout of bucket b with k sequence slots (k + 1 sequences in all, whatever the step holds):
- the step's chunks (m <= k) first, each its tokens from its start, in item order;
- k - m one-token padding sequences (token 0 at position 0, no KV written, state from the zero
  slot into the pad slot), so that every graph of k slots sees k + 1 sequences;
- the bucket's remaining tokens (at least one 64-token block) as a last padding sequence of the
  same kind, which also absorbs the unused entries of the graph's fixed-size checkpoint list
  (its first block, saved to the pad slot).
So every kernel sees the shapes it was captured with, and nothing real is touched. The layout's
checkpoint list holds b / 64 + k - 1 entries: at most that many block boundaries fall inside m
chunks of at most b - 64 - (k - m) tokens. Logits rows: the last token of each of the k slots
(the padding's are read by nobody).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kernels import CHUNK, Checkpoints
from statechat.devices import accelerator
from statechat.engine.graphs import aligned32
from statechat.model.context import Context


class Chunk(NamedTuple):
    """One sequence's part of a step: its token ids (list or int64 array) from position
    `start`, their KV slots (int64 array), its GDN state's source and destination slots, its
    block table and its checkpoints ((boundary, slot) pairs)."""

    ids: list[int] | np.ndarray
    start: int
    slot_mapping: np.ndarray
    src: int
    dst: int
    table: list[int]
    checkpoints: list[tuple[int, int]]


def checkpoint_entries(b: int, k: int) -> int:
    """The checkpoint list's length in bucket b with k sequence slots (see the module
    docstring)."""
    return b // CHUNK + k - 1


def fits(tokens: int, chunks: int, b: int, k: int) -> bool:
    """Whether `chunks` chunks of `tokens` tokens in all fit bucket b with k slots: the unused
    slots' one-token paddings and a whole block of padding after them."""
    return chunks <= k and tokens + (k - chunks) <= b - CHUNK


class PrefillStaging:
    """Pinned host buffers (two sets, used in turn, so that staging a step does not wait for
    the one before to run) and the device buffers the graphs read, for buckets of up to B
    tokens and k of up to K slots.

    int64 inputs: ids, positions, slot_mapping [B each], logits rows [K]; int32 inputs:
    cu_seqlens [K + 2], src, dst, context_lens [K + 1 each], checkpoint seq, boundary and slot
    [B / 64 + K - 1 each], then the chunks' block tables (staged only). Each int32 field starts
    on 16 bytes (ALIGN32 entries), as a tensor of its own does: the kernels see the alignment
    an eager step gives them, so Triton builds them once for both. One asynchronous copy per
    dtype."""

    def __init__(self, B: int, K: int, max_blocks: int, pad_slot: int,
                 device: torch.device) -> None:
        self.B, self.K, self.max_blocks, self.pad_slot = B, K, max_blocks, pad_slot
        self.head_width = aligned32(K + 2)
        self.ckpt_width = aligned32(checkpoint_entries(B, K))
        self.n32 = 4 * self.head_width + 3 * self.ckpt_width
        pinned = device.type != "cpu"
        self.hosts = []
        for _ in range(2):
            host32 = torch.zeros(self.n32 + K * max_blocks, dtype=torch.int32, pin_memory=pinned)
            self.hosts.append((torch.zeros(3 * B + K, dtype=torch.int64, pin_memory=pinned),
                               host32, self._fields32(host32.numpy()),
                               accelerator(device).Event() if pinned else None))
        self.turn = 0
        self.dev64 = torch.zeros(3 * B + K, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(self.n32, dtype=torch.int32, device=device)
        # block tables, one row a sequence slot, as wide as a whole bucket, which any sequence
        # may span. The padding's rows are never staged: a padding sequence reads whichever
        # valid block ids a row holds (zeros, or a chunk's of an earlier step), as its outputs
        # are read by nobody.
        self.tables = torch.zeros(K + 1, max(max_blocks, B // CHUNK), dtype=torch.int32,
                                  device=device)
        self.slot_index = torch.arange(K, dtype=torch.int64, device=device)  # (logits_seqs)

    def _fields32(self, buf: torch.Tensor | np.ndarray) -> tuple:
        """The int32 fields of a staging buffer (tensor or array): cu_seqlens, src, dst,
        context_lens, and the checkpoints' seq, boundary and slot columns."""
        a, cp = self.head_width, self.ckpt_width
        heads = [buf[i * a : (i + 1) * a] for i in range(4)]
        return (*heads, *(buf[4 * a + i * cp : 4 * a + (i + 1) * cp] for i in range(3)))

    def context(self, b: int, k: int, rope_table: torch.Tensor | None) -> Context:
        """The step of bucket b with k slots, read from the device buffers."""
        B, c, v64, S = self.B, checkpoint_entries(b, k), self.dev64, k + 1
        cu, src, dst, ctx, seq, boundary, slot = self._fields32(self.dev32)
        return Context(
            positions=v64[B : B + b], cu_seqlens=cu[: S + 1], is_decode=False,
            state_src=src[:S], state_dst=dst[:S], slot_mapping=v64[2 * B : 2 * B + b],
            block_tables=self.tables[:S], context_lens=ctx[:S],
            checkpoints=Checkpoints(seq[:c], boundary[:c], slot[:c]),
            logits_indices=v64[3 * B : 3 * B + k], logits_seqs=self.slot_index[:k],
            pad_seqs=1, rope_table=rope_table,
        )

    def ids(self, b: int) -> torch.Tensor:
        return self.dev64[:b]

    def stage(self, b: int, k: int, chunks: list[Chunk]) -> None:
        """Stage the chunks in bucket b's layout of k slots, and copy them over."""
        B, c, m = self.B, checkpoint_entries(b, k), len(chunks)
        lens = [len(ch.ids) for ch in chunks]
        if not fits(sum(lens), m, b, k) or k > self.K:
            raise ValueError(f"{m} chunks of {sum(lens)} tokens do not fit bucket {b} of {k}")
        host64, host32, fields, copied = self.hosts[self.turn]
        self.turn ^= 1
        # this set's copies of two steps ago must be done (the step before, on the other set,
        # may still be queued: a step that samples nothing leaves the host unsynchronised)
        if copied is not None:
            copied.synchronize()
        h64, h32 = host64.numpy(), host32.numpy()
        ids, positions, slots = h64[:B], h64[B : 2 * B], h64[2 * B : 3 * B]
        cu, srcs, dsts, ctx = fields[:4]
        targets, tok = [], 0
        for i, ch in enumerate(chunks):
            n = lens[i]
            ids[tok : tok + n] = ch.ids
            positions[tok : tok + n] = np.arange(ch.start, ch.start + n)
            slots[tok : tok + n] = ch.slot_mapping
            tok += n
            cu[i + 1], srcs[i], dsts[i], ctx[i] = tok, ch.src, ch.dst, ch.start + n
            targets += [(i, boundary, slot) for boundary, slot in ch.checkpoints]
        rows = np.cumsum(lens, dtype=np.int64) - 1
        extra = k - m  # the unused slots: one token each
        ids[tok : tok + extra], positions[tok : tok + extra], slots[tok : tok + extra] = 0, 0, -1
        h64[3 * B : 3 * B + k] = np.concatenate([rows, np.arange(tok, tok + extra)])
        cu[m + 1 : k + 1] = np.arange(tok + 1, tok + extra + 1)
        srcs[m:k], dsts[m:k], ctx[m:k] = 0, self.pad_slot, 1
        tok += extra
        pad = b - tok  # the last padding sequence: at least a block
        ids[tok:b], positions[tok:b], slots[tok:b] = 0, np.arange(pad), -1
        cu[0], cu[k + 1], srcs[k], dsts[k], ctx[k] = 0, b, 0, self.pad_slot, pad
        targets += [(k, CHUNK, self.pad_slot)] * (c - len(targets))
        for field, column in zip(fields[4:], zip(*targets)):
            field[:c] = column
        self.dev64.copy_(host64, non_blocking=True)
        self.dev32.copy_(host32[: self.n32], non_blocking=True)
        at = self.n32
        for i, ch in enumerate(chunks):
            if ch.table:
                h32[at : at + len(ch.table)] = ch.table
                self.tables[i, : len(ch.table)].copy_(host32[at : at + len(ch.table)],
                                                      non_blocking=True)
                at += len(ch.table)
        if copied is not None:
            copied.record()
