"""The disk tier's byte budget (LRU eviction: rows first, then blobs) and people's operations
on a cache dir: stats, ls, gc and clear (verify is verify.py's)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time

from statechat.cache.blobs.encoding import BLOB_NAME
from statechat.cache.store.budget import default_budget, gc_budget, recorded_budget
from statechat.cache.store.freeing import (
    EVICTION_ORDER,
    TMP_MIN_AGE_S,
    delete_blob_files,
    in_use,
)

log = logging.getLogger("statechat.cache")
INDEX_FILE = "index.db"  # the index, in the cache dir (beside blobs/)
EVICT_BATCH = 256  # rows an eviction's write transaction deletes at most (an ORDER BY each)
# the segments none of whose blocks lies on a checkpoint's chain: (id, blob, bytes)
ORPHAN_SEGMENTS = (
    "WITH RECURSIVE up(hash) AS (SELECT hash FROM checkpoints UNION SELECT b.parent FROM "
    "blocks b JOIN up ON b.hash = up.hash) SELECT s.id, s.blob, coalesce(s.bytes, 0) FROM "
    "segments s WHERE NOT EXISTS (SELECT 1 FROM blocks b WHERE b.segment_id = s.id AND b.hash "
    "IN (SELECT hash FROM up))")


class StoreMaintenance:
    """StateStore's budget and reports. Works on the store's state (state_store.py): path,
    blob_dir, db, db_lock, host, budget and budget_explicit; `_discard_checkpoint`,
    `_discard_segment` and `_unlink_blob` come from reads.py."""

    def total_bytes(self) -> int:
        """The bytes of every blob the index has a row for (all models), kept as `bytes_used`
        (which /metrics shows without a query of its own)."""
        with self.db_lock:
            row = self.db.execute(
                "SELECT (SELECT coalesce(sum(bytes),0) FROM checkpoints) "
                "+ (SELECT coalesce(sum(bytes),0) FROM segments)"
            ).fetchone()
        self.bytes_used = int(row[0])
        return self.bytes_used

    def index_bytes(self) -> int:
        """The bytes of the index's files: index.db (the chats in it too), its write-ahead log
        and the log's shared memory (-wal, -shm), as they are now. The budget does not count
        them (budget.bound_log keeps the log small)."""
        size = 0
        for name in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):  # (none yet, or gone: a read-only cache's)
                size += (self.path / f"{INDEX_FILE}{name}").stat().st_size
        return size

    def evict_to(self, max_bytes: int) -> int:
        """Delete least recently used checkpoints and segments until the total fits; bytes freed.

        Every use and save of a checkpoint marks the segments under it as used at the same time
        (`index.touch_chain`), so a chain's rows tie. Ties go from the chain's end back to its
        start: a checkpoint or segment deeper in the conversation (its boundary, the segment's
        first block) first, a checkpoint before a segment. What stays is a shorter prefix that
        can still be resumed, never a checkpoint whose blocks are gone (unusable, yet counted
        in the budget). A segment left with no blocks (another process saved them first) holds
        nothing a lookup can use: it goes before the rows it ties with.

        The total is summed inside each write transaction, which deletes up to EVICT_BATCH
        rows: another process on the same cache dir may evict at the same time, and a total
        read before its deletions would have both free the whole overshoot.

        A segment none of whose blocks lies on a checkpoint's chain (its checkpoints evicted, or
        a save whose checkpoint was not indexed) can never be resumed from: where the total is
        past the budget, such segments go first, and those that the evicted checkpoints leave
        go with them (`_drop_orphan_segments`)."""
        freed = 0
        if self.total_bytes() <= max_bytes:  # (the common case, without the write lock)
            return 0
        while True:
            gone, total, batch_full = self._evict_batch(max_bytes)
            for blob, size in gone:
                if self._unlink_blob(blob):  # (not a file this process may not delete)
                    freed += size
            if total <= max_bytes or not batch_full:
                return freed

    def _evict_batch(self, max_bytes: int) -> tuple[list[tuple[str, int]], int, bool]:
        """One write transaction of evict_to: the orphan segments, then up to EVICT_BATCH rows
        in eviction order while the total is past `max_bytes`, and the segments the evicted
        checkpoints leave orphan. Gives the (blob, bytes) of the rows it deleted (their files
        are the caller's to delete, once it has committed), the total after it, and whether its
        batch was full (more rows may be left to evict)."""
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            total = self.total_bytes()
            gone = self._drop_orphan_segments() if total > max_bytes else []
            total -= sum(size for _, size in gone)
            rows = self.db.execute(EVICTION_ORDER,
                                   [EVICT_BATCH if total > max_bytes else 0]).fetchall()
            evicted = 0
            for kind, key, blob, size, _, _ in rows:
                if total <= max_bytes:
                    break
                if kind == "ckpt":
                    self.db.execute("DELETE FROM checkpoints WHERE hash = ?", [key])
                else:
                    self.db.execute("DELETE FROM blocks WHERE segment_id = ?", [key])
                    self.db.execute("DELETE FROM segments WHERE id = ?", [key])
                gone.append((blob, size))
                total -= size
                evicted += 1
            if evicted:  # (the segments that only the evicted checkpoints stood on)
                orphans = self._drop_orphan_segments()
                gone += orphans
                total -= sum(size for _, size in orphans)
        self.bytes_used = total  # (committed: what /metrics shows is what is left)
        return gone, total, len(rows) >= EVICT_BATCH

    def _drop_orphan_segments(self) -> list[tuple[str, int]]:
        """(In evict_to's transaction) Delete the rows of the segments none of whose blocks lies
        on a checkpoint's chain (the checkpoint's block and those before it): their (blob,
        bytes), the blobs to delete once the transaction commits."""
        rows = self.db.execute(ORPHAN_SEGMENTS).fetchall()
        for seg_id, _, _ in rows:
            self.db.execute("DELETE FROM blocks WHERE segment_id = ?", [seg_id])
            self.db.execute("DELETE FROM segments WHERE id = ?", [seg_id])
        return [(blob, size) for _, blob, size in rows]

    def budgets(self) -> dict:
        """{"bytes_budget": what this store evicts down to (its own where set, else what a plain
        `cache gc` keeps to: budget.gc_budget), "bytes_budget_default": the default rule's now,
        "budget_recorded": the last engine's (budget.recorded_budget)}."""
        with self.db_lock:
            recorded = recorded_budget(self.db)
            default = default_budget(self.path, self.total_bytes())
        return {"bytes_budget": self.budget if self.budget_explicit
                else gc_budget(recorded, default),
                "bytes_budget_default": default, "budget_recorded": recorded}

    def gc(self, max_bytes: int | None = None) -> int:
        """Evict down to `max_bytes` (default: `budgets()`'s, the last engine's budget where a
        user set it, else the default rule's) and delete orphan blob files."""
        if max_bytes is None:
            max_bytes = self.budgets()["bytes_budget"]
        freed = self.evict_to(max_bytes)
        return freed + sum(size for _, size in self._remove_orphans())

    def sweep_leftovers(self) -> None:
        """Delete the temporary blobs and orphan blobs (no row names them) that a writer killed
        mid-save left, older than the grace period that spares other processes' saves under
        way: the writer does it as it starts, so a crash's leftovers, outside the budget, do not
        wait for `statechat cache gc`. Never raises (the disk tier goes on without it)."""
        try:
            found = self._remove_orphans()
        except (OSError, sqlite3.Error) as e:
            log.info("statechat cache: leftover blobs not swept (%s)", e)
            return
        if found:
            log.info("statechat cache: removed %d leftover blob file(s) of an earlier crash "
                     "(%d bytes)", len(found), sum(size for _, size in found))

    def _remove_orphans(self, min_age_s: float = TMP_MIN_AGE_S,
                        remove: bool = True) -> list[tuple[str, int]]:
        """Blob files no row points at (a crash between rename and insert, a lost index), and
        stale temps, as (name under blobs/, bytes); deleted unless `remove` is False. Only files
        named as the store names its own (BLOB_NAME) count: anything else is left.

        A save keeps its blobs under temporary names until the transaction of their rows
        renames them (rows.py): so this reads the rows and deletes under the index's write
        lock, where no save of this version is between its rename and its rows, and leaves the
        temps of saves under way (`in_use`: a live writer's pid). Files younger than
        `min_age_s` stay too (an older version's writer renamed a blob before its row). Where a
        look without the lock finds none, the lock is not taken (an engine's start does not
        wait for another process's transaction when there is nothing to sweep)."""
        found = self._find_orphans(min_age_s, remove=False)
        if not remove or not found:
            return found
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            return self._find_orphans(min_age_s, remove)

    def _find_orphans(self, min_age_s: float, remove: bool) -> list[tuple[str, int]]:
        """_remove_orphans' search (and deletions), in its transaction where it deletes."""
        with self.db_lock:
            known = {r[0] for r in self.db.execute(
                "SELECT blob FROM checkpoints UNION SELECT blob FROM segments")}
        found, now = [], time.time()
        for f in sorted(self.blob_dir.rglob("*")) if self.blob_dir.exists() else []:
            rel = f.relative_to(self.blob_dir).as_posix()
            if rel in known or not BLOB_NAME.fullmatch(rel) or not f.is_file():
                continue
            with contextlib.suppress(FileNotFoundError):  # (another process removed it)
                st = f.stat()
                if now - st.st_mtime >= min_age_s and not in_use(rel, st.st_mtime, now):
                    if remove:
                        f.unlink()
                    found.append((rel, st.st_size))
        return found

    def stats(self) -> dict:
        """What the cache dir holds: counts of checkpoints, blocks and segments, bytes against
        the budget, this process's host tier, and a row per model (the cache_models view, with
        its exact "bytes" beside the view's rounded "mb")."""
        # the host tier's figures first, apart: a restore holds its lock while it takes db_lock
        host = self.host.stats()  # this process's host tier: used, capacity, not kept
        with self.db_lock:
            q = self.db.execute
            cols = ("id", "name", "dtype", "block_size", "checkpoints", "blocks", "mb")
            models = [dict(zip(cols, r)) for r in q("SELECT * FROM cache_models")]
            sizes = dict(q("SELECT model_id, sum(coalesce(bytes, 0)) FROM (SELECT model_id, "
                           "bytes FROM checkpoints UNION ALL SELECT model_id, bytes FROM "
                           "segments) GROUP BY model_id"))
            for m in models:
                m["bytes"] = sizes.get(m["id"], 0)
            return {
                "path": str(self.path),
                "num_checkpoints": q("SELECT count(*) FROM checkpoints").fetchone()[0],
                "num_blocks": q("SELECT count(*) FROM blocks").fetchone()[0],
                "num_segments": q("SELECT count(*) FROM segments").fetchone()[0],
                "bytes_total": self.total_bytes(),
                "bytes_index": self.index_bytes(),
                **self.budgets(),
                **host,
                "models": models,
            }

    def ls(self, limit: int = 50) -> list[dict]:
        """The `limit` most recently used checkpoints, newest first, as dicts; every one that
        `stats` counts, its "model" None where its models row is gone (an index edited by
        hand: `verify` removes it)."""
        with self.db_lock:
            cur = self.db.execute(
                "SELECT c.num_tokens, c.bytes, c.created, c.last_used, c.hits, m.name, c.hash "
                "FROM checkpoints c LEFT JOIN models m ON m.id = c.model_id "
                "ORDER BY c.last_used DESC LIMIT ?", [limit])
            cols = ("num_tokens", "bytes", "created", "last_used", "hits", "model", "hash")
            return [dict(zip(cols, r)) for r in cur]

    def clear(self) -> int:
        """Delete every cache row and blob (conversations kept), orphan blobs too; the bytes of
        the blob files deleted.

        The files go while the index's write lock is held: an engine in another process that
        has just renamed a blob into place indexes it only after this, in its own transaction,
        and then finds it gone (rows.py indexes only the blobs still there), so no row is left
        naming a deleted file. Temporary files younger than `TMP_MIN_AGE_S` are a writer's
        blob under way and are left alone (deleted, its save would fail with a warning).

        A deletion stopped part way (Ctrl+C, a file it may not delete) still commits the rows'
        deletion before it goes on up: the files deleted by then must lose their rows, and
        those left are orphans, which the next clear, gc or verify deletes."""
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            for table in ("checkpoints", "blocks", "segments"):
                self.db.execute(f"DELETE FROM {table}")
            try:
                return delete_blob_files(self.blob_dir)
            except BaseException:
                self.db.conn.commit()  # (rows first, then files: not rolled back after files)
                raise

    def forget_blobs(self, blobs: list[str]) -> None:
        """Delete the rows naming `blobs`, files deleted before them (freeing.py: the blob
        files of an eviction on a full disk), in one transaction."""
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            names = [(blob,) for blob in blobs]
            self.db.conn.executemany("DELETE FROM checkpoints WHERE blob = ?", names)
            self.db.conn.executemany("DELETE FROM blocks WHERE segment_id IN "
                                     "(SELECT id FROM segments WHERE blob = ?)", names)
            self.db.conn.executemany("DELETE FROM segments WHERE blob = ?", names)
