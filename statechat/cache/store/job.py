"""SaveJob: what the engine hands the store's writer thread to save (state_store.py, writer.py):
a checkpoint and the KV blocks before it that the disk lacks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class SaveJob:
    """A checkpoint and the KV blocks before it: snapshots taken on the device after a step
    (host copies on the CPU), moved to host memory by the writer thread.

    ckpt: tensors of the GDN state at the boundary (conv.{i}, ssm.{i}) or None
    blocks: [(hash hex, parent hex, position)], row i of block_tensors
    block_tensors: {k.{i}, v.{i}: [len(blocks), block_size, Hkv, D]}
    """

    ckpt_hash: str | None
    num_tokens: int
    ckpt: dict[str, torch.Tensor] | None
    blocks: list[tuple[str, str, int]] = field(default_factory=list)
    block_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: Callable[[], None] | None = None  # waits until device snapshots are complete
    queued_bytes: int = 0  # counted against the store's pending bound while queued
    chain: str | None = None  # the boundary's last block hash (hex): its checkpoint and the
    # segments of its chain on disk count as used now (index.touch_chain)
    chain_blocks: list[str] = field(default_factory=list)  # every block hash (hex) of that
    # chain, first to last: the checkpoint is indexed only if all are on disk after the job
    unsaved: Callable[[list[str], bool], None] | None = None  # see StoreWriter._report_unsaved

    def nbytes(self) -> int:
        """The bytes of the job's tensors, kept in `queued_bytes` too."""
        tensors = list(self.block_tensors.values()) + list((self.ckpt or {}).values())
        self.queued_bytes = sum(t.numel() * t.element_size() for t in tensors)
        return self.queued_bytes
