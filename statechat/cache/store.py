"""StateStore: the host and disk tiers of the state cache, with write-behind persistence.

    store = open_store(cache_dir)                   # people's operations: stats, ls, verify, gc
    store.attach(fingerprint, name, ...)            # an engine's model: lookups and saves
    store.where(block_hashes, ckpt_hashes)          # which lower tier holds what (a Lookup)
    with store.reading():                           # held until host-tier reads are launched
        store.load_blocks(hashes)                   # verified tensors: host tier, or disk (on
        store.load_checkpoint(h)                    # the engine's device when it is CUDA)
    store.save(SaveJob)                             # queued; a thread writes blobs, then rows

Writes never block the caller: a bounded queue drops (and counts) jobs it cannot take. The
writer holds back while the engine says it is launching work (`engine_busy`), for at most
MAX_DEFER_S per job: its Python steps would otherwise take the GIL from the kernel launches of
a prefill. A blob that fails verification is a miss: its rows and file are removed and one
warning is logged. The host tier (arena.py) is a ring in memory allocated when the store is
attached: a save copies into it and pins nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from statechat.cache import index
from statechat.cache.arena import HostTier
from statechat.cache.blobs import (
    BLOB_NAME,
    BlobError,
    BlobMeta,
    prepare_staging,
    read_blob,
    resident_fraction,
    write_blob,
)

log = logging.getLogger("statechat.cache")
UNREADABLE_S = 60.0  # a blob that could not be opened or read is left out of plans this long
_SEGMENT_POOL = ThreadPoolExecutor(4, thread_name_prefix="statechat-segment")

MAX_DEFER_S = 0.2  # the longest the writer waits for the engine over one job
RESIDENT_BLOBS = 16  # blobs of a plan's prefix whose page-cache share is asked (Lookup)
PREFETCH_INDEX_BYTES = 16 << 20  # an index up to this size is read ahead at each lookup
SAMPLE_MIN_BYTES = 4 << 20  # the smallest blob that times the page cache's rate at start
INDEX_FILE = "index.db"
BLOB_DIR = "blobs"


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

    def nbytes(self) -> int:
        tensors = list(self.block_tensors.values()) + list((self.ckpt or {}).values())
        self.queued_bytes = sum(t.numel() * t.element_size() for t in tensors)
        return self.queued_bytes


@dataclass
class Lookup:
    """What the lower tiers hold of a prefix (StateStore.where): the tier of each block and
    checkpoint, and for those on disk their blob, whose page-cache share `cached` asks of the
    OS once, when a plan first needs it."""

    blocks: dict[str, str]
    ckpts: dict[str, str]
    block_blobs: dict[str, str] = field(default_factory=dict)
    ckpt_blobs: dict[str, str] = field(default_factory=dict)
    blob_dir: Path = Path()
    resident: dict[str, float] = field(default_factory=dict)  # blob -> fraction, once asked
    sampled: dict[str, float] = field(default_factory=dict)  # kind -> mean of the asked blobs
    spread: dict[str, float] = field(default_factory=dict)  # kind -> max - min of those

    def cached(self, kind: str, h: str) -> float:
        """The fraction of the blob of a disk block ("kv") or checkpoint ("ckpt") that is in the
        page cache; 0.0 for what is not on disk. After `sample_residency`, a blob it did not
        ask about gets the mean of those it asked about of its kind."""
        blob = (self.block_blobs if kind == "kv" else self.ckpt_blobs).get(h)
        if blob is None:
            return 0.0
        if blob not in self.resident:
            if kind in self.sampled:
                return self.sampled[kind]
            self.resident[blob] = resident_fraction(self.blob_dir / blob)
        return self.resident[blob]

    def ask(self, kind: str, h: str) -> None:
        """Ask the OS now about the blob of `h` (if on disk), rather than estimate its share."""
        blob = (self.block_blobs if kind == "kv" else self.ckpt_blobs).get(h)
        if blob is not None and blob not in self.resident:
            self.resident[blob] = resident_fraction(self.blob_dir / blob)

    def known(self, kind: str, hashes: list[str]) -> bool:
        """Whether `cached` gives the page-cache share of every blob of `hashes` as asked, or
        estimated from a sample whose blobs agreed (within 5%)."""
        if self.spread.get(kind, 0.0) <= 0.05:
            return True
        blobs_of = self.block_blobs if kind == "kv" else self.ckpt_blobs
        return all(blobs_of[h] in self.resident for h in hashes if h in blobs_of)

    def sample_residency(self, hashes: list[str]) -> None:
        """Ask the OS about at most RESIDENT_BLOBS of the disk blobs of the prefix `hashes`,
        half of them segments and half checkpoints, each evenly spaced along the prefix from
        its first to its deepest (a 32k prefix has some 64 blobs, and each question costs tens
        of microseconds)."""
        for kind, blobs_of in (("kv", self.block_blobs), ("ckpt", self.ckpt_blobs)):
            ordered = list(dict.fromkeys(blobs_of[h] for h in hashes if h in blobs_of))
            quota = RESIDENT_BLOBS // 2
            if len(ordered) > quota:
                ordered = [ordered[round(i * (len(ordered) - 1) / (quota - 1))] for i in range(quota)]
            for blob in ordered:
                if blob not in self.resident:
                    self.resident[blob] = resident_fraction(self.blob_dir / blob)
            if ordered:
                shares = [self.resident[b] for b in ordered]
                self.sampled[kind] = sum(shares) / len(shares)
                self.spread[kind] = max(shares) - min(shares)


class StateStore:
    """The cache dir: index.db + blobs/, a host tier, and a write-behind thread."""

    def __init__(self, root: Path, budget_bytes: int | None = None, host_bytes: int = 0, queue_size: int = 64,
                 max_pending_bytes: int = 4 << 30, read_only: bool = False) -> None:
        self.path = Path(root)
        self.blob_dir = self.path / BLOB_DIR
        self.unreadable: dict[str, float] = {}  # blob -> when it could not be read (monotonic)
        self._fds: dict[str, tuple] = {}  # index file -> ((dev, inode), SQLite's descriptor)
        self.read_only = read_only  # index opened to read alone (index.connect_read_only)
        self.db = (index.connect_read_only if read_only else index.connect)(self.path / INDEX_FILE)
        self.db_lock = threading.RLock()  # one connection shared by the engine and writer threads
        self.budget = budget_bytes if budget_bytes is not None else default_budget(self.path)
        self.host = HostTier(host_bytes)
        self.device = torch.device("cpu")  # the engine's: where disk reads land on CUDA
        self.copy_stream: torch.cuda.Stream | None = None  # the writer's device-to-host copies
        self.model_id: int | None = None
        self.fingerprint = ""
        self.shapes: dict[str, dict[str, list[int]]] = {}
        self.dropped = 0
        self.max_pending_bytes = max_pending_bytes  # snapshots queued (device memory on a GPU)
        self.pending_bytes = 0
        self.pending_lock = threading.Lock()
        self.errors = 0
        self.queue: queue.Queue[SaveJob | None] = queue.Queue(maxsize=queue_size)
        self.writer: threading.Thread | None = None
        self.engine_idle = threading.Event()  # cleared while the engine launches work
        self.engine_idle.set()
        self._defer_left = 0.0  # what the writer may still wait for the engine in this job

    # --- model ------------------------------------------------------------------------
    def attach(self, fingerprint: str, name: str, model_path: str, dtype: str, block_size: int,
               shapes: dict[str, dict[str, list[int]]], device: torch.device | str = "cpu") -> None:
        """Bind the store to one model (fingerprint hex) on `device` and start the writer thread."""
        self.fingerprint, self.shapes, self.device = fingerprint, shapes, torch.device(device)
        self.host.reserve(self.device)  # the host tier's arena, pinned now rather than per save
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            prepare_staging(self.device)  # the restores' pinned buffers, also pinned now
        with self.db_lock:
            self.model_id = index.model_id(self.db, fingerprint, name, model_path, dtype, block_size)
            self.db.execute("UPDATE models SET shapes = ? WHERE id = ?", [json.dumps(shapes), self.model_id])
        self.writer = threading.Thread(target=self._write_loop, name="statechat-cache-writer", daemon=True)
        self.writer.start()

    # --- lookups ----------------------------------------------------------------------
    def where(self, block_hashes: list[str], ckpt_hashes: list[str], disk_blocks: bool = True) -> Lookup:
        """Which lower tier ("host" or "disk") holds each block and checkpoint that it has, and
        for those on disk their blob; `disk_blocks=False` leaves the blocks' disk tier out (the
        index is not asked about them)."""
        host = self.host.has
        self._prefetch_index()
        found = Lookup({h: "host" for h in block_hashes if host("kv", h)} if self.host.items else {},
                       {h: "host" for h in ckpt_hashes if host("ckpt", h)} if self.host.items else {})
        wanted_blocks = [h for h in block_hashes if h not in found.blocks] if disk_blocks else []
        wanted_ckpts = [h for h in ckpt_hashes if h not in found.ckpts]
        with self.db_lock:
            disk_blocks = index.blocks_present(self.db, wanted_blocks) if wanted_blocks else {}
            disk_ckpts = index.checkpoints_present(self.db, wanted_ckpts) if wanted_ckpts else {}
        found.blob_dir = self.blob_dir
        unreadable = self._unreadable_now()
        for h, row in disk_blocks.items():
            if row[0] not in unreadable:
                found.blocks[h], found.block_blobs[h] = "disk", row[0]
        for h, row in disk_ckpts.items():
            if row[0] not in unreadable:
                found.ckpts[h], found.ckpt_blobs[h] = "disk", row[0]
        return found

    def _unreadable_now(self) -> set[str]:
        """Blobs that could not be opened or read in the last UNREADABLE_S: plans leave them out
        (kept in the index; tried again after that)."""
        now = time.monotonic()
        with self.db_lock:
            for blob in [b for b, t in self.unreadable.items() if now - t > UNREADABLE_S]:
                del self.unreadable[blob]
            return set(self.unreadable)

    def _prefetch_index(self) -> None:
        """Have the kernel read the index (and its WAL) ahead, whole, if it is small: a lookup
        in an index the page cache dropped reads B-tree pages one at a time (5-10 ms for a 32k
        prompt on the H100 machine's disk), where one sequential read-ahead of a few MB takes
        about a millisecond. Nothing happens to files the page cache holds. The advice goes
        through the descriptors SQLite holds: opening and closing one of our own would drop
        every POSIX lock this process has on the file, SQLite's too, and another process
        closing its connection would then take the WAL for unused and delete it, with the
        writes this one goes on making in it (sqlite.org, "How To Corrupt", 2.2)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for name in (INDEX_FILE, INDEX_FILE + "-wal"):
            fd = self._sqlite_fd(name)
            try:
                if fd is not None and os.fstat(fd).st_size <= PREFETCH_INDEX_BYTES:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def _sqlite_fd(self, name: str) -> int | None:
        """A descriptor this process holds open on the cache dir's file `name` (SQLite's), from
        /proc/self/fd, looked up again only when the file is another (a new WAL); None where
        there is none, or no /proc."""
        try:
            st = os.stat(self.path / name)
        except OSError:
            return None
        key = _file_key(st)
        known = self._fds.get(name)
        if known is not None and known[0] == key:
            fd = known[1]
            with contextlib.suppress(OSError):
                if fd is None or _file_key(os.fstat(fd)) == key:
                    return fd
        fd = None
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc/self/fd"):
                with contextlib.suppress(OSError, ValueError):
                    if _file_key(os.stat(entry.path)) == key:
                        fd = int(entry.name)
                        break
        self._fds[name] = (key, fd)
        return fd

    def read_rate_sample(self) -> tuple[int, float] | None:
        """Time the read, as a restore reads it, of a recent checkpoint of this model that the
        page cache holds whole (at least SAMPLE_MIN_BYTES): (its bytes, the seconds of the faster
        of two reads), or None when there is none (a new cache dir, a cold page cache). An engine
        starts with it, so its first plan prices page-cache reads at this machine's rate (the
        H100 machines lent gave 2.6 to 8.6 GB/s) rather than at a guess."""
        with self.db_lock:
            rows = self.db.execute(
                "SELECT blob, bytes, checksum FROM checkpoints WHERE model_id = ? AND bytes >= ? "
                "ORDER BY last_used DESC LIMIT 4", [self.model_id, SAMPLE_MIN_BYTES]).fetchall()
        for blob, size, crc in rows:
            if resident_fraction(self.blob_dir / blob) < 0.99:
                continue
            times = []
            for _ in range(2):
                t = time.perf_counter()
                try:
                    read_blob(self.blob_dir / blob, self.fingerprint, self._shapes("ckpt"), crc, self.device)
                except BlobError:
                    break  # (a miss when a plan reads it: not this sample's to handle)
                times.append(time.perf_counter() - t)
            if len(times) == 2:
                return size, min(times)
        return None

    def blocks_on_disk_ahead(self, hashes: list[str]) -> Future:
        """The hashes of `hashes` whose blocks the disk tier holds (a set), asked of the index
        on the segment readers."""
        def present() -> set[str]:
            with self.db_lock:
                return set(index.blocks_present(self.db, hashes))
        return _SEGMENT_POOL.submit(present)

    def reading(self) -> AbstractContextManager[None]:
        """A context to hold while host-tier tensors from `load_blocks` and `load_checkpoint`
        are read: until the copies out of them are launched, the writer reuses none of their
        memory (HostTier.reading)."""
        return self.host.reading()

    def load_checkpoint(self, h: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors; BlobError (entry removed, warning logged) if unusable.
        Host-tier tensors are only safe to read inside `reading()`."""
        cached = self.host.get("ckpt", h)
        return cached if cached is not None else self.read_checkpoint(h)

    def read_checkpoint(self, h: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors from disk, never from the host tier (so any thread may call
        it, without `reading()`); BlobError (entry removed, warning logged) if unusable."""
        with self.db_lock:
            row = index.checkpoints_present(self.db, [h]).get(h)
        if row is None:
            raise BlobError(f"checkpoint {h[:12]} is no longer in the index")
        blob, _, crc = row
        try:
            tensors = read_blob(self.blob_dir / blob, self.fingerprint, self._shapes("ckpt"), crc, self.device)
        except BlobError as e:
            self._discard_checkpoint(h, blob, str(e), e.damaged)
            raise
        self._touch("checkpoints", "hash", h, hit=True)
        return tensors

    def read_checkpoint_ahead(self, h: str) -> Future:
        """`read_checkpoint(h)` on the segment readers, to overlap it with other reads; its
        result or error comes from the future."""
        return _SEGMENT_POOL.submit(self.read_checkpoint, h)

    def load_blocks(self, hashes: list[str]) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
        """The blocks' keys and values as groups (hashes, {k.{i}, v.{i}: [n, block_size, Hkv, D]})
        covering `hashes`: one group per disk segment (a slice of it when the rows are
        consecutive) and one per host-tier block. BlobError if any block is unusable. Host-tier
        tensors are only safe to read inside `reading()`."""
        groups: list[tuple[list[str], dict[str, torch.Tensor]]] = []
        missing, run, run_hashes = [], None, []  # run: (tensors, first row, last row)
        for h in hashes + [None]:
            entry = self.host.get("kv", h) if h is not None else None
            if run is not None and (entry is None or entry[0] is not run[0] or entry[1] != run[2] + 1):
                tensors, first, last = run  # consecutive rows of one saved job: one slice
                groups.append((run_hashes, {n: t[first : last + 1] for n, t in tensors.items()}))
                run, run_hashes = None, []
            if entry is not None:
                run = (entry[0], entry[1], entry[1]) if run is None else (run[0], run[1], entry[1])
                run_hashes.append(h)
            elif h is not None:
                missing.append(h)
        with self.db_lock:
            rows = index.blocks_present(self.db, missing)
        by_segment: dict[str, list[tuple[str, int]]] = {}
        for h in missing:
            if h not in rows:
                raise BlobError(f"block {h[:12]} is no longer in the index")
            by_segment.setdefault(rows[h][0], []).append((h, rows[h][1]))
        def read(blob: str, members: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
            num_blocks, crc = rows[members[0][0]][3], rows[members[0][0]][2]
            return read_blob(self.blob_dir / blob, self.fingerprint, self._shapes("kv", num_blocks), crc, self.device)

        # segments are read concurrently (each one's pieces in parallel too): a long prefix is
        # many segments of one checkpoint interval each
        futures = {blob: _SEGMENT_POOL.submit(read, blob, members) for blob, members in by_segment.items()}
        wait(futures.values())
        failed = [(blob, f.exception()) for blob, f in futures.items() if f.exception() is not None]
        for blob, error in failed:
            if isinstance(error, BlobError):
                self._discard_segment(blob, str(error), error.damaged)
        if failed:
            raise failed[0][1]
        for blob, members in by_segment.items():
            tensors = futures[blob].result()
            idx = [i for _, i in members]
            if idx == list(range(idx[0], idx[0] + len(idx))):
                picked = {name: t[idx[0] : idx[0] + len(idx)] for name, t in tensors.items()}
            else:
                picked = {name: t[torch.tensor(idx, device=t.device)] for name, t in tensors.items()}
            groups.append(([h for h, _ in members], picked))
            self._touch("segments", "blob", blob)
        return groups

    def _shapes(self, kind: str, num_blocks: int = 1) -> dict[str, tuple[int, ...]]:
        if kind == "ckpt":
            return {k: tuple(v) for k, v in self.shapes["ckpt"].items()}
        return {k: (num_blocks, *v) for k, v in self.shapes["block"].items()}

    def _touch(self, table: str, key: str, value: str, hit: bool = False) -> None:
        extra = ", hits = hits + 1" if hit else ""
        with self.db_lock, self.db.conn:
            self.db.execute(f"UPDATE {table} SET last_used = ?{extra} WHERE {key} = ?", [time.time(), value])

    def _discard_checkpoint(self, h: str, blob: str, why: str, damaged: bool = True) -> None:
        if not damaged:  # (its contents may be fine: kept, and left out of plans for a while)
            self._set_aside(blob, why)
            return
        log.warning("statechat cache: %s; dropped it (recomputing instead)", why)
        with self.db_lock, self.db.conn:
            self.db.execute("DELETE FROM checkpoints WHERE hash = ?", [h])
        (self.blob_dir / blob).unlink(missing_ok=True)

    def _set_aside(self, blob: str, why: str) -> None:
        log.warning("statechat cache: %s; kept it, unused for %d s (recomputing instead)", why, UNREADABLE_S)
        with self.db_lock:
            self.unreadable[blob] = time.monotonic()

    def _discard_segment(self, blob: str, why: str, damaged: bool = True) -> None:
        if not damaged:
            self._set_aside(blob, why)
            return
        log.warning("statechat cache: %s; dropped it (recomputing instead)", why)
        with self.db_lock, self.db.conn:
            seg = self.db.execute("SELECT id FROM segments WHERE blob = ?", [blob]).fetchone()
            if seg:
                self.db.execute("DELETE FROM blocks WHERE segment_id = ?", [seg[0]])
                self.db.execute("DELETE FROM segments WHERE id = ?", [seg[0]])
        (self.blob_dir / blob).unlink(missing_ok=True)

    # --- writes -----------------------------------------------------------------------
    def save(self, job: SaveJob) -> bool:
        """Queue a job for the writer; False when the queue is full (the caller counts what it
        finally does not save in `dropped`).
        The writer copies it into the host tier (or, where it does not fit, into pageable
        memory) and writes it to disk.
        Snapshots waiting in the queue are bounded in bytes too: past the bound a job is dropped
        rather than letting them grow into the memory the engine's pools were sized from."""
        size = job.nbytes()
        with self.pending_lock:
            if self.pending_bytes + size > self.max_pending_bytes or self.queue.full():
                return False
            self.pending_bytes += size
        self.queue.put_nowait(job)
        return True

    def has_room(self, nbytes: int, wait_s: float = 0.0) -> bool:
        """Whether `save` would take a job of `nbytes` now; with `wait_s`, wait up to that long
        for the writer to make room (not for a job the bound can never hold)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.pending_lock:
                if self.pending_bytes + nbytes <= self.max_pending_bytes and not self.queue.full():
                    return True
            if nbytes > self.max_pending_bytes or self.writer is None or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def engine_busy(self, busy: bool) -> None:
        """The engine is launching work (True) or waiting on the device or idle (False)."""
        if busy:
            self.engine_idle.clear()
        else:
            self.engine_idle.set()

    def _pause(self) -> None:
        """Wait while the engine launches work, for at most MAX_DEFER_S over one job (the
        budget is reset as a job starts): a long run of prefill chunks delays a write, it does
        not starve it, and a blob never waits long for its row."""
        if self.engine_idle.is_set() or self._defer_left <= 0:
            return
        t = time.perf_counter()
        self.engine_idle.wait(self._defer_left)
        self._defer_left -= time.perf_counter() - t

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued job is on disk (tests, shutdown)."""
        deadline = time.time() + timeout
        while self.queue.unfinished_tasks and time.time() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self.writer is not None:
            self.flush()
            self.queue.put(None)
            self.writer.join(timeout=10)
            self.writer = None

    def _write_loop(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception as e:  # noqa: BLE001 - a failed write must never stop generation
                self.errors += 1
                log.warning("statechat cache: could not persist a checkpoint (%s)", e)
            finally:
                if job is not None:
                    with self.pending_lock:
                        self.pending_bytes -= job.queued_bytes
                self.queue.task_done()

    def _write(self, job: SaveJob) -> None:
        self._defer_left = MAX_DEFER_S
        self._pause()
        if job.ready is not None:
            job.ready()
        hashes = [b[0] for b in job.blocks]
        job.ckpt, job.block_tensors = self.host.keep(job.ckpt_hash, job.ckpt, hashes,
                                                     job.block_tensors, self.copy_stream)
        with self.db_lock:
            on_disk = index.blocks_present(self.db, hashes)
            have_ckpt = bool(job.ckpt_hash) and bool(index.checkpoints_present(self.db, [job.ckpt_hash]))
        rows = [i for i, b in enumerate(job.blocks) if b[0] not in on_disk]
        new_blocks = [job.blocks[i] for i in rows]
        now = time.time()
        seg = None
        if new_blocks:
            tensors = job.block_tensors
            if len(rows) < len(job.blocks):
                tensors = {n: t[torch.tensor(rows)] for n, t in tensors.items()}
            blob = f"kv/{uuid.uuid4().hex}.safetensors"
            block_size = next(iter(tensors.values())).shape[1]
            meta = BlobMeta(self.fingerprint, len(new_blocks) * block_size, [b[0] for b in new_blocks], "kv")
            size, crc = write_blob(self.blob_dir / blob, tensors, meta, self._pause)
            seg = (blob, len(new_blocks), size, crc)
        ck = None
        if job.ckpt is not None and job.ckpt_hash and not have_ckpt:
            blob = f"ckpt/{job.ckpt_hash[:2]}/{job.ckpt_hash}-{uuid.uuid4().hex[:8]}.safetensors"
            meta = BlobMeta(self.fingerprint, job.num_tokens, [job.ckpt_hash], "ckpt")
            size, crc = write_blob(self.blob_dir / blob, job.ckpt, meta, self._pause)
            ck = (blob, size, crc)
        self._pause()
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            if seg is not None:
                cur = self.db.execute(
                    "INSERT INTO segments (model_id, blob, num_blocks, bytes, checksum, created, last_used) "
                    "VALUES (?,?,?,?,?,?,?)", [self.model_id, seg[0], seg[1], seg[2], seg[3], now, now])
                seg_id = cur.lastrowid
                self.db.conn.executemany(
                    "INSERT OR IGNORE INTO blocks (hash, model_id, parent, position, segment_id, seg_index) "
                    "VALUES (?,?,?,?,?,?)",
                    [(h, self.model_id, parent, pos, seg_id, i) for i, (h, parent, pos) in enumerate(new_blocks)],
                )
            if ck is not None:
                self.db.execute(
                    "INSERT OR IGNORE INTO checkpoints (hash, model_id, num_tokens, blob, bytes, checksum, "
                    "created, last_used, hits) VALUES (?,?,?,?,?,?,?,?,0)",
                    [job.ckpt_hash, self.model_id, job.num_tokens, ck[0], ck[1], ck[2], now, now])
        self.evict_to(self.budget)

    # --- maintenance (people's operations) ---------------------------------------------
    def total_bytes(self) -> int:
        with self.db_lock:
            row = self.db.execute(
                "SELECT (SELECT coalesce(sum(bytes),0) FROM checkpoints) + (SELECT coalesce(sum(bytes),0) FROM segments)"
            ).fetchone()
        return int(row[0])

    def evict_to(self, max_bytes: int) -> int:
        """Delete least recently used checkpoints and segments until the total fits; bytes freed."""
        freed, total = 0, self.total_bytes()
        while total > max_bytes:
            with self.db_lock, self.db.conn:
                self.db.execute("BEGIN IMMEDIATE")
                row = self.db.execute(
                    "SELECT 'ckpt', hash, blob, bytes, last_used FROM checkpoints UNION ALL "
                    "SELECT 'kv', id, blob, bytes, last_used FROM segments ORDER BY 5 LIMIT 1"
                ).fetchone()
                if row is None:
                    break
                kind, key, blob, size, _ = row
                if kind == "ckpt":
                    self.db.execute("DELETE FROM checkpoints WHERE hash = ?", [key])
                else:
                    self.db.execute("DELETE FROM blocks WHERE segment_id = ?", [key])
                    self.db.execute("DELETE FROM segments WHERE id = ?", [key])
            (self.blob_dir / blob).unlink(missing_ok=True)
            freed += size
            total -= size
        return freed

    def gc(self, max_bytes: int | None = None) -> int:
        """Evict down to `max_bytes` (default: the budget) and delete orphan blob files."""
        freed = self.evict_to(self.budget if max_bytes is None else max_bytes)
        return freed + sum(size for _, size in self._remove_orphans())

    def _remove_orphans(self, min_age_s: float = 60.0, remove: bool = True) -> list[tuple[str, int]]:
        """Blob files no row points at (a crash between rename and insert, a lost index), and
        stale temps, as (name under blobs/, bytes); deleted unless `remove` is False. Only files
        named as the store names its own (BLOB_NAME) count: anything else is left."""
        with self.db_lock:
            known = {r[0] for r in self.db.execute("SELECT blob FROM checkpoints UNION SELECT blob FROM segments")}
        found, now = [], time.time()
        for f in sorted(self.blob_dir.rglob("*")) if self.blob_dir.exists() else []:
            rel = f.relative_to(self.blob_dir).as_posix()
            if rel in known or not BLOB_NAME.fullmatch(rel) or not f.is_file():
                continue
            with contextlib.suppress(FileNotFoundError):  # (another process removed it)
                st = f.stat()
                # a concurrent writer's fresh file may not have its row yet: leave young files
                if now - st.st_mtime >= min_age_s:
                    if remove:
                        f.unlink()
                    found.append((rel, st.st_size))
        return found

    def verify(self, remove: bool = True) -> dict:
        """Check every row's blob (present, readable, checksum, model, shapes) and look for
        orphan blob files. Damaged entries and orphans are deleted, or with `remove=False` (a
        read-only cache) only reported; a blob that cannot be read is reported and kept.
        Returns {"checked", "ok", "removed" (damaged blobs), "unreadable", "orphans" (orphan
        blobs), "orphans_freed" (their bytes, if deleted)}."""
        with self.db_lock:
            models = {r[0]: (r[1], json.loads(r[2] or "{}")) for r in
                      self.db.execute("SELECT id, fingerprint, shapes FROM models")}
            ckpts = self.db.execute("SELECT hash, model_id, blob, checksum FROM checkpoints").fetchall()
            segs = self.db.execute("SELECT id, model_id, blob, checksum, num_blocks FROM segments").fetchall()
        checked, removed, unreadable = 0, [], []
        for h, mid, blob, crc in ckpts:
            checked += 1
            fp, shapes = models.get(mid, ("", {}))
            try:
                read_blob(self.blob_dir / blob, fp, {k: tuple(v) for k, v in shapes.get("ckpt", {}).items()}, crc)
            except BlobError as e:
                if remove:
                    self._discard_checkpoint(h, blob, str(e), e.damaged)
                (removed if e.damaged else unreadable).append(blob)
        for sid, mid, blob, crc, n in segs:
            checked += 1
            fp, shapes = models.get(mid, ("", {}))
            try:
                read_blob(self.blob_dir / blob, fp, {k: (n, *v) for k, v in shapes.get("block", {}).items()}, crc)
            except BlobError as e:
                if remove:
                    self._discard_segment(blob, str(e), e.damaged)
                (removed if e.damaged else unreadable).append(blob)
        orphans = self._remove_orphans(remove=remove)
        return {"checked": checked, "ok": checked - len(removed) - len(unreadable), "removed": removed,
                "unreadable": unreadable, "orphans": [name for name, _ in orphans],
                "orphans_freed": sum(size for _, size in orphans) if remove else 0}

    def stats(self) -> dict:
        # the host tier's figures first, apart: a restore holds its lock while it takes db_lock
        host = self.host.stats()  # this process's host tier: used, capacity, not kept
        with self.db_lock:
            q = self.db.execute
            models = [dict(zip(("id", "name", "dtype", "block_size", "checkpoints", "blocks", "mb"), r))
                      for r in q("SELECT * FROM cache_models")]
            return {
                "path": str(self.path),
                "num_checkpoints": q("SELECT count(*) FROM checkpoints").fetchone()[0],
                "num_blocks": q("SELECT count(*) FROM blocks").fetchone()[0],
                "num_segments": q("SELECT count(*) FROM segments").fetchone()[0],
                "bytes_total": self.total_bytes(),
                "bytes_budget": self.budget,
                **host,
                "models": models,
            }

    def ls(self, limit: int = 50) -> list[dict]:
        with self.db_lock:
            cur = self.db.execute(
                "SELECT c.num_tokens, c.bytes, c.created, c.last_used, c.hits, m.name, c.hash "
                "FROM checkpoints c JOIN models m ON m.id = c.model_id ORDER BY c.last_used DESC LIMIT ?", [limit])
            cols = ("num_tokens", "bytes", "created", "last_used", "hits", "model", "hash")
            return [dict(zip(cols, r)) for r in cur]

    def clear(self) -> int:
        """Delete every cache row and blob (conversations kept); bytes freed."""
        total = self.total_bytes()
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            for table in ("checkpoints", "blocks", "segments"):
                self.db.execute(f"DELETE FROM {table}")
        for f in sorted(self.blob_dir.rglob("*"), reverse=True) if self.blob_dir.exists() else []:
            # the store's own files, then the folders they leave empty (another file stays)
            if f.is_file() and BLOB_NAME.fullmatch(f.relative_to(self.blob_dir).as_posix()):
                f.unlink(missing_ok=True)
            elif f.is_dir() and not any(f.iterdir()):
                with contextlib.suppress(OSError):  # (a writer's new file just went in)
                    f.rmdir()
        return total


def _file_key(st: os.stat_result) -> tuple[int, int]:
    """What names a file whatever its path: (device, inode)."""
    return st.st_dev, st.st_ino


def default_budget(root: Path) -> int:
    """10% of the free space of the cache dir's file system (of its nearest existing folder:
    nothing is created)."""
    root = Path(root).absolute()
    while not root.exists() and root != root.parent:
        root = root.parent
    return int(shutil.disk_usage(root).free * 0.10)


def open_store(cache_dir: str | os.PathLike, budget_bytes: int | None = None, host_bytes: int = 0,
               read_only: bool = False) -> StateStore:
    """The store of `cache_dir` (created if missing); with `read_only`, one whose index is
    only read and never created (index.connect_read_only): for reports."""
    return StateStore(Path(cache_dir), budget_bytes, host_bytes, read_only=read_only)
