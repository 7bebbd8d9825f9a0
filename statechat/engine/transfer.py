"""The runner's state transfer for the lower cache tiers: snapshots of GDN slots and KV blocks
(device copies queued on the compute stream, each one allocation, which the cache's writer
moves to host memory), their loads back into the device pools, and their shapes.

A mixin of ModelRunner (engine/runner.py), which owns the tensors it reads and writes.
"""

from __future__ import annotations

import math

import torch

from statechat.devices import accelerator


class StateTransfer:
    """Reads and writes of ModelRunner's caches (`self.caches`, `self.device`, `self._tensor`)
    for the host and disk tiers."""

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """A snapshot of one GDN state slot: conv.{i} [W-1, conv_dim], ssm.{i} [HV, K, V]."""
        names = [f"conv.{i}" for i in range(len(self.caches.conv))]
        names += [f"ssm.{i}" for i in range(len(self.caches.ssm))]
        sources = [pool[slot] for pool in self.caches.conv + self.caches.ssm]
        views = _views_of_one_buffer([(t.shape, t.dtype) for t in sources], self.device)
        for dtype in {t.dtype for t in sources}:  # one multi-tensor copy per dtype (conv, ssm)
            pairs = [(v, t) for v, t in zip(views, sources) if t.dtype == dtype]
            torch._foreach_copy_([v for v, _ in pairs], [t for _, t in pairs])
        return dict(zip(names, views))

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """A snapshot of KV blocks: {k.{i}, v.{i}: [n, block_size, Hkv, D]}, row j = block j."""
        idx = self._tensor(block_ids, torch.int64)
        names = [f"k.{i}" for i in range(len(self.caches.k))]
        names += [f"v.{i}" for i in range(len(self.caches.v))]
        sources = self.caches.k + self.caches.v
        specs = [((len(block_ids), *c.shape[1:]), c.dtype) for c in sources]
        views = _views_of_one_buffer(specs, self.device)
        for view, cache in zip(views, sources):
            torch.index_select(cache, 0, idx, out=view)
        return dict(zip(names, views))

    def snapshot_ready(self):
        """A callable that waits until the snapshots queued so far exist (None on the CPU).
        Snapshots are device copies queued on the compute stream (the step never waits); the
        cache's writer moves them to host memory once they exist."""
        if self.device.type == "cpu":
            return None
        event = self._event()
        event.record()
        return event.synchronize

    def _event(self):
        return accelerator(self.device).Event()

    def write_slot(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint (read_slot's tensors, on the device or in host memory) into GDN
        state slot `slot`, asynchronously."""
        for i, pool in enumerate(self.caches.conv):
            pool[slot].copy_(tensors[f"conv.{i}"], non_blocking=True)
        for i, pool in enumerate(self.caches.ssm):
            pool[slot].copy_(tensors[f"ssm.{i}"], non_blocking=True)

    def write_blocks(self, block_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Load KV blocks: tensors {k.{i}, v.{i}: [n, block_size, Hkv, D]} (on the device, or in
        host memory, pinned on an accelerator: one asynchronous copy per layer) into device
        blocks `block_ids`."""
        idx = self._tensor(block_ids, torch.int64)
        for i, (kc, vc) in enumerate(zip(self.caches.k, self.caches.v)):
            kc[idx] = tensors[f"k.{i}"].to(self.device, non_blocking=True)
            vc[idx] = tensors[f"v.{i}"].to(self.device, non_blocking=True)

    def state_shapes(self) -> dict[str, dict[str, list[int]]]:
        """Shapes of a checkpoint's and a KV block's tensors (checked on every load)."""
        c = self.caches
        ckpt = {f"conv.{i}": list(p.shape[1:]) for i, p in enumerate(c.conv)}
        ckpt.update({f"ssm.{i}": list(p.shape[1:]) for i, p in enumerate(c.ssm)})
        block = {f"k.{i}": list(p.shape[1:]) for i, p in enumerate(c.k)}
        block.update({f"v.{i}": list(p.shape[1:]) for i, p in enumerate(c.v)})
        return {"ckpt": ckpt, "block": block}


def _views_of_one_buffer(
    specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Tensors of the given shapes and dtypes as views of one new buffer (widest dtypes first,
    so each starts aligned): a snapshot is one allocation, and the writer moves it to host
    memory in one copy."""
    order = sorted(range(len(specs)), key=lambda i: -specs[i][1].itemsize)
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    views: list[torch.Tensor | None] = [None] * len(specs)
    offset = 0
    for i in order:
        shape, dtype = specs[i]
        views[i] = buf[offset : offset + sizes[i]].view(dtype).view(shape)
        offset += sizes[i]
    return views
