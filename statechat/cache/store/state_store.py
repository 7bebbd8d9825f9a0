"""StateStore: the cache dir (index.db + blobs/), a host tier and a write-behind thread, bound
to one model by `attach`. This module holds the store's state and how it is opened; its
methods live by concern in reads.py, writer.py, maintenance.py and verify.py. The host tier
(arena.py) is a ring in memory allocated when the store is attached.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sqlite3
import threading
from pathlib import Path

import torch

from statechat.cache import index, index_read, sqlite_files
from statechat.cache.arena import HostTier
from statechat.cache.blobs.read import prepare_staging
from statechat.cache.store.budget import bound_log, default_budget
from statechat.cache.store.failures import FailedSaves
from statechat.cache.store.job import SaveJob
from statechat.cache.store.maintenance import INDEX_FILE, StoreMaintenance
from statechat.cache.store.readahead import IndexReadAhead
from statechat.cache.store.reads import StoreReads
from statechat.cache.store.verify import StoreVerify
from statechat.cache.store.writer import StoreWriter
from statechat.errors import ConfigError

BLOB_DIR = "blobs"
log = logging.getLogger("statechat.cache")


class StateStore(StoreReads, StoreWriter, StoreMaintenance, StoreVerify):
    """The cache dir: index.db + blobs/, a host tier, and a write-behind thread."""

    def __init__(self, root: Path, budget_bytes: int | None = None, host_bytes: int = 0,
                 queue_size: int = 64, max_pending_bytes: int = 4 << 30,
                 read_only: bool = False) -> None:
        self.path = Path(root)
        self.blob_dir = self.path / BLOB_DIR
        if self.blob_dir.exists() and not self.blob_dir.is_dir():
            raise ConfigError(f"{self.blob_dir} is a file; move it away (the cache keeps its "
                              "blobs in that folder)")
        self.unreadable: dict[str, float] = {}  # blob -> when it could not be read (monotonic)
        self.unlink_failed = False  # a blob file could not be deleted (said once: reads.py)
        self.index_ahead = IndexReadAhead(self.path, INDEX_FILE)  # SQLite's descriptors, advised
        self.read_only = read_only  # index opened to read alone (index_read.py)
        self.db = (index_read.connect_read_only if read_only else index.connect)(
            self.path / INDEX_FILE)
        self.db_lock = threading.RLock()  # one connection shared by the engine and writer threads
        self.bytes_used = 0  # the blobs' bytes as last summed (total_bytes: at open, and after
        # each of this process's saves; another process's since are not seen until then)
        own = self._own_bytes()
        self.budget = budget_bytes if budget_bytes is not None else default_budget(self.path, own)
        self.budget_explicit = budget_bytes is not None  # set, not the default (budget.py)
        if not read_only:
            bound_log(self.db, self.budget)
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
        self.touched: dict[str, float] = {}  # chain -> when a reuse last used it (`touch`)
        self.hit_counts: dict[str, int] = {}  # checkpoint -> disk reads not written (`count_hit`)
        self.errors = 0  # saves that failed (a full disk, a lock held elsewhere)
        self.num_saved_checkpoints = 0  # checkpoints this store indexed (their rows committed)
        self.failed_saves = FailedSaves(self.path)  # how they are told: a line per cause
        self.failed: str | None = None  # why the index failed (`give_up`): the disk tier is off
        self.queue: queue.Queue[SaveJob | None] = queue.Queue(maxsize=queue_size)
        self.writer: threading.Thread | None = None
        self.engine_idle = threading.Event()  # cleared while the engine launches work
        self.engine_idle.set()
        self._defer_left = 0.0  # what the writer may still wait for the engine in this job

    def _own_bytes(self) -> int:
        """The bytes of the blobs the index names (0 where it cannot say: a read-only index of
        no tables yet)."""
        try:
            return self.total_bytes()
        except sqlite3.Error:
            return 0

    def attach(self, fingerprint: str, name: str, model_path: str, dtype: str, block_size: int,
               shapes: dict[str, dict[str, list[int]]], device: torch.device | str = "cpu") -> None:
        """Bind the store to one model (fingerprint hex) on `device` and start the writer thread.

        A model the index does not know yet needs its row written. Where another process holds
        the index locked past the busy timeout (a `sqlite3` shell inside a transaction), that
        costs this process its disk tier, not its start: one warning, `failed` set (the engine
        then goes on from memory, as after `give_up`), and no writer."""
        self.fingerprint, self.shapes, self.device = fingerprint, shapes, torch.device(device)
        self.host.reserve(self.device)  # the host tier's arena, pinned now rather than per save
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            prepare_staging(self.device)  # the restores' pinned buffers, also pinned now
        with self.db_lock:
            try:
                index.check_integrity(self.db)  # (not the first lookup that reads a bad page)
                self.model_id = index.model_id(self.db, fingerprint, name, model_path, dtype,
                                               block_size)
                # (written only when new: a start then writes nothing to a known model's index,
                # and goes on while another process holds it locked, a `sqlite3` shell in BEGIN)
                known = self.db.execute("SELECT shapes FROM models WHERE id = ?",
                                        [self.model_id]).fetchone()
                if known is None or known[0] != json.dumps(shapes):
                    self.db.execute("UPDATE models SET shapes = ? WHERE id = ?",
                                    [json.dumps(shapes), self.model_id])
            except sqlite3.DatabaseError as e:  # (a damaged index.db: one line, no traceback)
                if not sqlite_files.is_locked(e):
                    raise sqlite_files.open_error(self.path / INDEX_FILE, e,
                                                  whole=True) from None
                self.failed = "locked by another process"
                log.warning("statechat cache: %s is locked by another process (a `sqlite3` shell "
                            "inside a transaction?), so this model's entry could not be written; "
                            "the disk cache is off until statechat restarts (requests go on "
                            "from memory)", self.path / INDEX_FILE)
                return
        self._start_writer()

    def give_up(self, error: sqlite3.DatabaseError) -> None:
        """The index failed under a running engine (a damaged index.db, a disk I/O error): turn
        the disk tier off for the rest of the process rather than fail again on every request.
        The first call logs one warning naming the cache dir and the error; from then on the
        writer drops what is queued, and the engine stops asking (`failed` is set). Any thread
        may call it; index.db is left as it is, for its owner to check."""
        with self.pending_lock:
            if self.failed is not None:
                return
            self.failed = (str(error).splitlines() or [type(error).__name__])[0]
        log.warning("statechat cache: the index of %s failed (%s); the disk cache is off until "
                    "statechat restarts (requests go on from memory), and `statechat cache "
                    "verify` checks it then", self.path, self.failed)

    def close(self) -> None:
        """Finish the queued writes, stop the writer thread and close the index. Its
        write-ahead log is folded into index.db, and where no other connection has the file
        open (the chats, another process), SQLite removes index.db-wal and -shm. Nothing of the
        store is used after this; a second call does nothing. A write still under way after the
        waits keeps the index open for its row (until the process ends; a later call waits
        again)."""
        if not self.stop_writer():  # (a write still under way keeps the index it needs)
            return
        with self.db_lock:
            if not self.read_only and self.failed is None:  # (a failed index: left as it is)
                with contextlib.suppress(sqlite3.Error):  # (PASSIVE: never waits for others)
                    self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.db.conn.close()


def open_store(cache_dir: str | os.PathLike, budget_bytes: int | None = None, host_bytes: int = 0,
               read_only: bool = False) -> StateStore:
    """The store of `cache_dir` (created if missing); with `read_only`, one whose index is
    only read and never created (index_read.connect_read_only): for reports."""
    return StateStore(Path(cache_dir), budget_bytes, host_bytes, read_only=read_only)
