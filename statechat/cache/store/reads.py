"""The store's read path: which lower tier holds a prefix (`where`), loading its blocks and
checkpoints (host tier, else disk, verified), and what an unusable blob does to the index.

A blob that fails verification is a miss: its rows and file are removed and one warning is
logged. A blob that could not be opened or read says nothing of its contents: it is kept, and
left out of plans for UNREADABLE_S.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from statechat.cache import index
from statechat.cache.blobs.encoding import BLOB_NAME, BlobError
from statechat.cache.blobs.read import read_blob
from statechat.cache.blobs.residency import resident_fraction
from statechat.cache.store.lookup import Lookup

log = logging.getLogger("statechat.cache")
UNREADABLE_S = 60.0  # a blob that could not be opened or read is left out of plans this long
RECOMPUTING = " (recomputing instead)"  # how a lookup's warning of a bad blob ends
_SEGMENT_POOL = ThreadPoolExecutor(4, thread_name_prefix="statechat-segment")
SAMPLE_MIN_BYTES = 4 << 20  # the smallest blob that times the page cache's rate at start

Groups = list[tuple[list[str], dict[str, torch.Tensor]]]  # (hashes, {k.{i}, v.{i}: [n, ...]})


def blob_path(blob_dir: Path, blob: object, what: str) -> Path:
    """The file of an index row's `blob`; BlobError where the row names none (NULL, an empty
    text: a hand edit), `what` naming the row."""
    if not isinstance(blob, str) or not blob:
        raise BlobError(f"{what} names no blob file")
    return blob_dir / blob


class StoreReads:
    """StateStore's lookups and loads. Works on the store's state (state_store.py): path,
    blob_dir, db, db_lock, host, device, fingerprint, shapes, model_id, unreadable and
    index_ahead; `count_hit` comes from writer.py."""

    def where(self, block_hashes: list[str], ckpt_hashes: list[str],
              disk_blocks: bool = True) -> Lookup:
        """Which lower tier ("host" or "disk") holds each block and checkpoint that it has, and
        for those on disk their blob; `disk_blocks=False` leaves the blocks' disk tier out (the
        index is not asked about them)."""
        host = self.host.has
        self.index_ahead.prefetch()
        found = Lookup(
            {h: "host" for h in block_hashes if host("kv", h)} if self.host.items else {},
            {h: "host" for h in ckpt_hashes if host("ckpt", h)} if self.host.items else {})
        wanted_blocks = [h for h in block_hashes if h not in found.blocks] if disk_blocks else []
        wanted_ckpts = [h for h in ckpt_hashes if h not in found.ckpts]
        with self.db_lock:
            disk_blocks = index.blocks_present(self.db, wanted_blocks) if wanted_blocks else {}
            disk_ckpts = index.checkpoints_present(self.db, wanted_ckpts) if wanted_ckpts else {}
        found.blob_dir = self.blob_dir
        unreadable = self._unreadable_now()
        # (a row naming no blob, NULL by a hand edit, is planned as a cold one: its read fails)
        for h, row in disk_blocks.items():
            if row[0] not in unreadable:
                found.blocks[h] = "disk"
                if isinstance(row[0], str):
                    found.block_blobs[h] = row[0]
        for h, row in disk_ckpts.items():
            if row[0] not in unreadable:
                found.ckpts[h] = "disk"
                if isinstance(row[0], str):
                    found.ckpt_blobs[h] = row[0]
        return found

    def _unreadable_now(self) -> set[str]:
        """Blobs that could not be opened or read in the last UNREADABLE_S: plans leave them out
        (kept in the index; tried again after that)."""
        now = time.monotonic()
        with self.db_lock:
            for blob in [b for b, t in self.unreadable.items() if now - t > UNREADABLE_S]:
                del self.unreadable[blob]
            return set(self.unreadable)

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
            if not isinstance(blob, str) or resident_fraction(self.blob_dir / blob) < 0.99:
                continue
            times = []
            for _ in range(2):
                t = time.perf_counter()
                try:
                    read_blob(self.blob_dir / blob, self.fingerprint, self._shapes("ckpt"), crc,
                              self.device)
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
            tensors = read_blob(blob_path(self.blob_dir, blob, f"checkpoint {h[:12]}"),
                                self.fingerprint, self._shapes("ckpt"), crc, self.device,
                                hashes={0: h})
        except BlobError as e:
            self._discard_checkpoint(h, blob, str(e), e.damaged)
            raise
        self.count_hit(h)  # (its last_used, and its segments', move with the restore's `touch`)
        return tensors

    def read_checkpoint_ahead(self, h: str) -> Future:
        """`read_checkpoint(h)` on the segment readers, to overlap it with other reads; its
        result or error comes from the future."""
        return _SEGMENT_POOL.submit(self.read_checkpoint, h)

    def load_blocks(self, hashes: list[str]) -> Groups:
        """The blocks' keys and values as groups (hashes, {k.{i}, v.{i}: [n, block_size, Hkv, D]})
        covering `hashes`: one group per disk segment (a slice of it when the rows are
        consecutive) and one per host-tier block. BlobError if any block is unusable. Host-tier
        tensors are only safe to read inside `reading()`."""
        groups, missing = self._host_groups(hashes)
        groups += self._disk_groups(missing)
        return groups

    def _host_groups(self, hashes: list[str]) -> tuple[Groups, list[str]]:
        """The groups of `hashes` the host tier holds (consecutive rows of one saved job: one
        slice), and the hashes it lacks, in order."""
        groups: Groups = []
        missing, run, run_hashes = [], None, []  # run: (tensors, first row, last row)
        for h in hashes + [None]:
            entry = self.host.get("kv", h) if h is not None else None
            if run is not None and (entry is None or entry[0] is not run[0]
                                    or entry[1] != run[2] + 1):
                tensors, first, last = run  # consecutive rows of one saved job: one slice
                groups.append((run_hashes, {n: t[first : last + 1] for n, t in tensors.items()}))
                run, run_hashes = None, []
            if entry is not None:
                run = (entry[0], entry[1], entry[1]) if run is None else (run[0], run[1], entry[1])
                run_hashes.append(h)
            elif h is not None:
                missing.append(h)
        return groups, missing

    def _disk_groups(self, missing: list[str]) -> Groups:
        """The groups of `missing` read from their disk segments, one group per segment;
        BlobError if any is not in the index or its segment is unusable (removed, logged)."""
        with self.db_lock:
            rows = index.blocks_present(self.db, missing)
        # (segment id, its blob) -> [(hash, seg_index)]: an id alone may name two segments, one
        # evicted by another process between two of blocks_present's queries and one it saved
        # after (SQLite gives the highest id again once it is free)
        by_segment: dict[tuple[int, str | None], list[tuple[str, int]]] = {}
        for h in missing:
            if h not in rows:
                raise BlobError(f"block {h[:12]} is no longer in the index")
            by_segment.setdefault((rows[h][4], rows[h][0]), []).append((h, rows[h][1]))

        def read(seg: tuple[int, str | None],
                 members: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
            num_blocks, crc = rows[members[0][0]][3], rows[members[0][0]][2]
            return read_blob(blob_path(self.blob_dir, seg[1], f"segment {seg[0]}"),
                             self.fingerprint, self._shapes("kv", num_blocks), crc, self.device,
                             hashes={i: h for h, i in members})

        # segments are read concurrently (each one's pieces in parallel too): a long prefix is
        # many segments of one checkpoint interval each
        futures = {seg: _SEGMENT_POOL.submit(read, seg, members)
                   for seg, members in by_segment.items()}
        wait(futures.values())
        failed = [(seg, f.exception()) for seg, f in futures.items() if f.exception() is not None]
        for (sid, blob), error in failed:
            if isinstance(error, BlobError):
                self._discard_segment(blob, str(error), error.damaged, sid=sid)
        if failed:
            raise failed[0][1]
        groups: Groups = []
        for seg, members in by_segment.items():
            tensors = futures[seg].result()
            idx = [i for _, i in members]
            if idx == list(range(idx[0], idx[0] + len(idx))):
                picked = {name: t[idx[0] : idx[0] + len(idx)] for name, t in tensors.items()}
            else:
                picked = {name: t[torch.tensor(idx, device=t.device)]
                          for name, t in tensors.items()}
            groups.append(([h for h, _ in members], picked))
        return groups

    def _shapes(self, kind: str, num_blocks: int = 1) -> dict[str, tuple[int, ...]]:
        if kind == "ckpt":
            return {k: tuple(v) for k, v in self.shapes["ckpt"].items()}
        return {k: (num_blocks, *v) for k, v in self.shapes["block"].items()}

    def _discard_checkpoint(self, h: str, blob: str, why: str, damaged: bool = True,
                            then: str = RECOMPUTING) -> None:
        """Drop a damaged checkpoint's row and blob (one warning: `why`, and `then`, what
        follows for the caller: a lookup recomputes, `verify` goes on)."""
        if not damaged:  # (its contents may be fine: kept, and left out of plans for a while)
            self._set_aside(blob, why, then)
            return
        log.warning("statechat cache: %s; dropped it%s", why, then)
        with self.db_lock, self.db.conn:  # (its row alone: not one another process saved
            # since, naming a new blob)
            self.db.execute("DELETE FROM checkpoints WHERE hash = ? AND blob IS ?", [h, blob])
        self._unlink_blob(blob, unless_named=True)

    def _unlink_blob(self, blob: str, unless_named: bool = False) -> bool:
        """Delete the file of an index row's `blob`, if it is named as the store names its own
        (BLOB_NAME): a row damaged or edited to name another file ("/home/me/notes.txt",
        "../x") loses its row, never that file. `unless_named`: kept where another row still
        names it (a row edited to name another row's blob is dropped alone). False where a
        file this process may not delete is left (said once)."""
        if not isinstance(blob, str) or not BLOB_NAME.fullmatch(blob):
            return True
        if unless_named:
            with self.db_lock:
                if self.db.execute("SELECT 1 FROM checkpoints WHERE blob = ? UNION ALL "
                                   "SELECT 1 FROM segments WHERE blob = ? LIMIT 1",
                                   [blob, blob]).fetchone():
                    return True
        try:
            (self.blob_dir / blob).unlink(missing_ok=True)
            return True
        except OSError as e:  # (another user's file, a run under sudo's: its row is gone, the
            # file stays, an orphan; the lookup, eviction or verify goes on)
            if not self.unlink_failed:
                log.warning("statechat cache: could not delete %s (%s); check the permissions "
                            "of %s and of the files in it", e.filename or blob, e.strerror or e,
                            self.blob_dir)
            self.unlink_failed = True
            return False

    def _set_aside(self, blob: str, why: str, then: str = RECOMPUTING) -> None:
        """Leave an unreadable blob out of plans for UNREADABLE_S (a lookup's), or just keep it
        (`verify`'s: `then` empty)."""
        if not then:
            log.warning("statechat cache: %s; kept it", why)
            return
        log.warning("statechat cache: %s; kept it, unused for %d s%s", why, UNREADABLE_S, then)
        with self.db_lock:
            self.unreadable[blob] = time.monotonic()

    def _discard_segment(self, blob: str | None, why: str, damaged: bool = True,
                         then: str = RECOMPUTING, sid: int | None = None) -> None:
        """Drop a damaged segment's rows and blob (see _discard_checkpoint): the segment `sid`
        while it still names `blob` (another process may have freed the id and saved a new
        segment under it), else the one naming `blob`."""
        if not damaged:
            self._set_aside(blob, why, then)
            return
        log.warning("statechat cache: %s; dropped it%s", why, then)
        with self.db_lock, self.db.conn:
            seg = (self.db.execute("SELECT id FROM segments WHERE id = ? AND blob IS ?",
                                   [sid, blob]).fetchone()
                   if sid is not None else
                   self.db.execute("SELECT id FROM segments WHERE blob = ?", [blob]).fetchone())
            if seg:
                self.db.execute("DELETE FROM blocks WHERE segment_id = ?", [seg[0]])
                self.db.execute("DELETE FROM segments WHERE id = ?", [seg[0]])
        self._unlink_blob(blob, unless_named=True)
