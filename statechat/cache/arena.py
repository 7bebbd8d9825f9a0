"""The host tier: copies of checkpoints and KV blocks in one arena of host memory, made once.

    host = HostTier(budget)
    host.reserve(device)                      # at attach: the arena (pinned on an accelerator)
    ckpt, blocks = host.keep(...)             # writer thread: snapshots -> regions, then entries
    with host.reading():                      # engine thread: get, then launch the copies
        tensors = host.get("ckpt", h)

Why an arena: a save that pinned fresh memory called cudaHostAlloc, which takes the driver's
lock and stalled the engine thread's launches for 20 ms a prompt; torch's caching host allocator
could not hand freed blocks back, as the tier kept every copy. The arena is `budget` bytes in
slabs, pinned once when the store is attached, and a save copies into it.

Regions are handed out as a ring (PinnedArena): a buffer never spans two slabs, and the entries
whose regions a new one overlaps leave the tier, so eviction is first in, first out. A buffer
larger than a slab (or any buffer when the budget is 0) goes to pageable memory, is written to
disk and is not kept.

A region is never overwritten while it is read: a reader holds `reading()` from its first `get`
until the copies out of what it got are launched, and on CUDA records `last_read` on its stream
as it lets go. The writer takes the same lock to evict and claim a region, and makes its copy
stream wait for `last_read` before it copies in: a wait on the GPU, never on the host. Without
a copy stream (an NPU) the writer copies on its thread's current stream, the default one that
the engine launches on too, so its copies run after the reads launched before them. On the
CPU the writer copies with numpy, on its own thread alone (hostcopy.py says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from statechat.cache import hostcopy
from statechat.errors import ConfigError

SLAB_BYTES = 256 << 20  # a power of two: torch's pinned allocator rounds every block up to one
ALIGN = 512  # region starts: any dtype's views line up, and copies start on a DMA-friendly offset

Key = tuple[str, str]  # ("ckpt" | "kv", hash hex)


@dataclass(eq=False)
class Region:
    """Bytes [start, start + nbytes) of one slab, and the host-tier keys that live in them."""

    slab: int
    start: int
    nbytes: int
    keys: list[Key] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.nbytes


class PinnedArena:
    """`capacity` bytes of host memory in equal slabs of at most `slab_bytes` (what is left of
    the capacity below one slab is not used), allocated at once and handed out as a ring."""

    def __init__(self, capacity: int, pin: bool, slab_bytes: int = SLAB_BYTES) -> None:
        if capacity < 1 or slab_bytes < 1:
            raise ValueError(f"an arena needs a capacity and slabs of 1 byte or more, got "
                             f"{capacity} and {slab_bytes}")
        self.slab_bytes = min(slab_bytes, capacity)
        num_slabs = capacity // self.slab_bytes
        try:
            self.slabs = [torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=pin)
                          for _ in range(num_slabs)]
        except RuntimeError as e:  # the OS or driver refused to lock that much memory
            raise ConfigError(
                f"could not allocate a {'pinned ' if pin else ''}host cache of "
                f"{capacity >> 20} MiB "
                f"({e.__class__.__name__}); lower host_cache_bytes (0 turns the host tier off)"
            ) from None
        self.live: list[list[Region]] = [[] for _ in self.slabs]  # per slab, oldest first
        self.head = (0, 0)  # (slab, offset) where the next region starts

    @property
    def capacity(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def allocate(self, nbytes: int,
                 keep: Sequence[Region] = ()) -> tuple[Region, list[Region]] | None:
        """A region of `nbytes` at the head of the ring (the next slab's start when the rest of
        this one is too short) and the live regions it overlaps, which are no longer live. None,
        with the ring unchanged, for a buffer larger than a slab or a region that would overlap
        one of `keep` (regions still being filled)."""
        if nbytes > self.slab_bytes:
            return None
        slab, start = self.head
        if start + nbytes > self.slab_bytes:
            slab, start = (slab + 1) % len(self.slabs), 0
        region = Region(slab, start, nbytes)
        overlapped = [r for r in self.live[slab] if r.start < region.end and start < r.end]
        if any(r in keep for r in overlapped):
            return None
        self.live[slab] = [r for r in self.live[slab] if r not in overlapped] + [region]
        self.head = (slab, -(-region.end // ALIGN) * ALIGN)
        return region, overlapped

    def view(self, region: Region, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The region's bytes as a tensor of `dtype` and `shape`."""
        return self.slabs[region.slab][region.start : region.end].view(dtype).view(shape)


class HostTier:
    """Host copies of checkpoints ({name: tensor}) and KV blocks ((tensors, row) of a save),
    in a PinnedArena of `budget` bytes; evicted first in, first out."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ConfigError(f"host_cache_bytes must be 0 or more, got {budget}")
        self.budget = budget
        self.arena: PinnedArena | None = None  # made by reserve; without one nothing is kept
        self.items: dict[Key, tuple[object, list[Region]]] = {}  # entry, the regions it lives in
        self.lock = threading.RLock()  # readers' whole restores, the writer's evict-and-claim
        self.device = torch.device("cpu")
        self.last_read: torch.cuda.Event | None = None  # the last copies out of the arena (CUDA)
        self.not_kept = 0  # bytes of saves written to disk only (no arena, or larger than a slab)

    def reserve(self, device: torch.device) -> None:
        """Allocate the arena for an engine on `device`: pinned on an accelerator. Called when
        the store is attached (engine start), so that no save pins memory."""
        self.device = torch.device(device)
        if self.budget and self.arena is None:
            pin = self.device.type != "cpu"
            self.arena = PinnedArena(self.budget, pin=pin, slab_bytes=SLAB_BYTES)
        if self.device.type == "cuda":
            self.last_read = torch.cuda.Event()

    # --- the engine thread ----------------------------------------------------------------
    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the tier still while what `get` returns is read: from before the first `get`
        until the copies out of it are launched (on the CPU they are done by then). The writer
        waits meanwhile; on CUDA its later copies into the arena also wait, on the GPU, for the
        copies launched here."""
        with self.lock:
            try:
                yield
            finally:
                if self.last_read is not None:
                    self.last_read.record(torch.cuda.current_stream(self.device))

    def get(self, kind: str, h: str):
        with self.lock:
            held = self.items.get((kind, h))
            return None if held is None else held[0]

    def has(self, kind: str, h: str) -> bool:
        return (kind, h) in self.items

    def stats(self) -> dict[str, int]:
        """Bytes of the regions that hold entries, and the arena's capacity (0: none)."""
        with self.lock:
            regions = {id(r): r for _, rs in self.items.values() for r in rs}
            used = sum(r.nbytes for r in regions.values())
        return {"host_bytes_used": used,
                "host_bytes_capacity": self.arena.capacity if self.arena else 0,
                "host_bytes_not_kept": self.not_kept}

    # --- the writer thread ----------------------------------------------------------------
    def keep(self, ckpt_hash: str | None, ckpt: dict[str, torch.Tensor] | None,
             block_hashes: list[str], blocks: dict[str, torch.Tensor],
             stream: torch.cuda.Stream | None = None,
             ) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
        """Move a save's snapshots to host memory (one copy per buffer) and keep them: a
        checkpoint as `ckpt_hash`, row i of `blocks` as block_hashes[i]. A buffer goes into a
        region of the arena, else (no arena, larger than a slab) to pageable memory, and a part
        with a buffer outside the arena is not kept. Returns the host tensors, to be written to
        disk. Given a CUDA `stream` the copies run on it and only it is waited for."""
        claimed: list[Region] = []  # this save's regions: none is handed out twice
        ckpt_regions: list[Region | None] = []
        block_regions: list[Region | None] = []
        # a snapshot buffer larger than a slab (a long run of blocks) moves tensor by tensor
        largest = self.arena.slab_bytes if self.arena is not None else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if ckpt is not None and ckpt_hash:
                ckpt = _moved(
                    ckpt, lambda t: self._move(t, ckpt_regions, claimed, stream), largest
                )
            blocks = _moved(
                blocks, lambda t: self._move(t, block_regions, claimed, stream), largest
            )
        if stream is not None:
            stream.synchronize()  # before readers may see the regions or the snapshots go
        with self.lock:
            if ckpt and ckpt_hash and None not in ckpt_regions:
                self._add(("ckpt", ckpt_hash), ckpt, ckpt_regions)
            elif ckpt and ckpt_hash and self.arena is not None:
                self.not_kept += _nbytes(ckpt)
            if blocks and None not in block_regions:
                for row, h in enumerate(block_hashes):
                    self._add(("kv", h), (blocks, row), block_regions)
            elif blocks and self.arena is not None:
                self.not_kept += _nbytes(blocks)
        return ckpt, blocks

    def _move(self, t: torch.Tensor, regions: list[Region | None], claimed: list[Region],
              stream: torch.cuda.Stream | None) -> torch.Tensor:
        region = self._claim(t.numel() * t.element_size(), claimed, stream)
        regions.append(region)
        if region is None:
            return t.to("cpu")  # pageable, only to be written (on the CPU: the snapshot itself)
        claimed.append(region)
        held = self.arena.view(region, t.dtype, t.shape)
        if t.device.type == "cpu":  # (on this thread alone: hostcopy.py says why)
            return hostcopy.copy_into(held, t)
        # without a copy stream (an NPU) the copy is done when this returns
        return held.copy_(t, non_blocking=stream is not None)

    def _claim(self, nbytes: int, claimed: list[Region],
               stream: torch.cuda.Stream | None) -> Region | None:
        """A region for `nbytes` (None: keep it out of the arena), its old entries evicted.
        Under the lock no reader is between its `get` and its launches; a reader that gets
        afterwards no longer finds the evicted entries."""
        if self.arena is None:
            return None
        with self.lock:
            got = self.arena.allocate(nbytes, claimed)
            if got is None:
                return None
            region, overlapped = got
            for old in overlapped:
                self._evict(old)
            if stream is not None and self.last_read is not None:
                stream.wait_event(self.last_read)  # copies launched out of it may still run
        return region

    def _add(self, key: Key, entry: object, regions: list[Region]) -> None:
        """Keep `entry` (a newer copy replaces an older one, which then has no key)."""
        self.items[key] = (entry, regions)
        for r in regions:
            r.keys.append(key)

    def _evict(self, region: Region) -> None:
        for key in region.keys:
            held = self.items.get(key)
            if held is not None and region in held[1]:
                del self.items[key]


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _moved(
    tensors: dict[str, torch.Tensor],
    move: Callable[[torch.Tensor], torch.Tensor],
    largest: int | None = None,
) -> dict[str, torch.Tensor]:
    """`move` applied once per buffer: tensors that tile one buffer exactly (a runner's
    snapshot) come back as the same views of one moved buffer; any other tensor is moved on
    its own, so a view into a pool never moves the pool, and so is each tensor of a buffer
    larger than `largest` bytes."""
    sizes: dict[int, int] = {}  # bytes of each buffer
    spans: dict[int, list[tuple[int, int]]] = {}  # byte ranges of the tensors on each buffer
    for t in tensors.values():
        storage, start = t.untyped_storage(), t.storage_offset() * t.element_size()
        sizes[storage.data_ptr()] = storage.nbytes()
        end = start + t.numel() * t.element_size()
        spans.setdefault(storage.data_ptr(), []).append((start, end))
    tiled = {key: _tiles(sorted(ranges), sizes[key]) for key, ranges in spans.items()}
    buffers: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        key = storage.data_ptr()
        too_large = largest is not None and sizes[key] > largest
        if not t.is_contiguous() or not tiled[key] or too_large:  # a view of more, overlapping
            out[name] = move(t)
            continue
        if key not in buffers:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            buffers[key] = move(whole)
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        out[name] = buffers[key][start:end].view(t.dtype).view(t.shape)
    return out


def _tiles(ranges: list[tuple[int, int]], nbytes: int) -> bool:
    """Whether sorted byte ranges cover [0, nbytes) exactly, without overlap."""
    end = 0
    for start, stop in ranges:
        if start != end:
            return False
        end = stop
    return end == nbytes
