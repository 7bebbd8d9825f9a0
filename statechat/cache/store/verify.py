"""`statechat cache verify`: every row's blob checked (present, readable, checksum, model,
shapes, and the block hashes its metadata lists against the rows that name it), orphan blob
files found, and the checkpoints that a damaged segment leaves without a whole chain."""

from __future__ import annotations

import json

from statechat.cache import index
from statechat.cache.blobs.encoding import BlobError
from statechat.cache.blobs.read import own_identity, read_blob
from statechat.cache.store.reads import blob_path


def _whole_chains(heads: list[str], parents: dict[str, str], roots: set[str]) -> set[str]:
    """The hashes of `heads` whose chain of blocks (`parents`: block hash -> the one before
    it) is whole back to one of `roots` (a model's fingerprint, the first block's parent)."""
    whole, broken = set(roots), set()
    for head in heads:
        path, h = [], head
        while h not in whole and h not in broken and h in parents:
            path.append(h)
            h = parents[h]
        (whole if h in whole else broken).update(path)
    return {h for h in heads if h in whole}


def _shapes(text: str | None) -> dict:
    """A models row's `shapes` (JSON text), {} where it is not a JSON object (a hand edit)."""
    try:
        shapes = json.loads(text or "{}")
    except ValueError:
        return {}
    return shapes if isinstance(shapes, dict) else {}


def _label(blob: str | None, row: str) -> str:
    """How `verify` names a row's blob: its name, or for a row naming none (NULL) the row."""
    return blob if isinstance(blob, str) and blob else f"{row} (no blob file)"


class StoreVerify:
    """StateStore's verify. Works on the store's state (state_store.py): blob_dir, db and
    db_lock; `_discard_checkpoint`, `_discard_segment` and `_unlink_blob` come from reads.py,
    `_remove_orphans` from maintenance.py."""

    def verify(self, remove: bool = True) -> dict:
        """Check every row's blob (present, readable, checksum, model, shapes) and look for
        orphan blob files. Damaged entries, the checkpoints they leave without a block of their
        chain, and orphans are deleted, or with `remove=False` (a read-only cache) only
        reported; a blob that cannot be read is reported and kept.
        Returns {"checked", "ok", "removed" (damaged blobs), "unreadable", "dangling" (blobs of
        checkpoints left without a block of their chain, also deleted), "orphans" (orphan
        blobs), "orphans_freed" (their bytes, if deleted), "mismatched_models" ([{"id", "name",
        "blobs"}]: models rows that do not match their blobs, which are kept)}.
        sqlite3.DatabaseError if the index itself is damaged.

        A blob whose header names another model, or other tensors or shapes, than its `models`
        row, yet is sound as its header says (its checksum, its hashes), is kept: the row was
        edited by hand (as the public schema allows), and the blob is still what an engine of
        its model resumes from (lookups go by block hash); the row is reported instead. A row
        whose model row is gone (deleted) belongs to no model, and is removed."""
        with self.db_lock:
            index.check_integrity(self.db)
            models = {r[0]: (r[1], _shapes(r[2])) for r in
                      self.db.execute("SELECT id, fingerprint, shapes FROM models")}
            names = dict(self.db.execute("SELECT id, name FROM models").fetchall())
            ckpts = self.db.execute(
                "SELECT hash, model_id, blob, checksum FROM checkpoints").fetchall()
            segs = self.db.execute(
                "SELECT id, model_id, blob, checksum, num_blocks FROM segments").fetchall()
            members: dict[int, dict] = {}  # segment id -> {seg_index: hash} of its block rows
            for sid, i, h in self.db.execute("SELECT segment_id, seg_index, hash FROM blocks"):
                members.setdefault(sid, {})[i] = h
        checked, removed, unreadable, damaged_segments = 0, [], [], set()
        mismatched: dict[int, list[str]] = {}  # model id -> its blobs, sound, that its row
        own_fps: set[str] = set()  # does not match; the fingerprints those blobs give
        for h, mid, blob, crc in ckpts:
            checked += 1
            fp, shapes = models.get(mid, ("", {}))
            try:
                expected = {k: tuple(v) for k, v in shapes.get("ckpt", {}).items()}
                read_blob(blob_path(self.blob_dir, blob, f"checkpoint {h[:12]}"), fp, expected,
                          crc, hashes={0: h})
            except BlobError as e:
                if not self._still_indexed("checkpoints", "hash", h, blob):
                    checked -= 1  # (evicted meanwhile, by a running engine: not damage)
                    continue
                if self._sound_as_its_own(e, mid in models, blob, {0: h}, crc, own_fps):
                    mismatched.setdefault(mid, []).append(blob)
                    continue
                if remove:
                    self._discard_checkpoint(h, blob, str(e), e.damaged, then="")
                (removed if e.damaged else unreadable).append(_label(blob, f"checkpoint {h}"))
        for sid, mid, blob, crc, n in segs:
            checked += 1
            fp, shapes = models.get(mid, ("", {}))
            try:
                expected = {k: (n, *v) for k, v in shapes.get("block", {}).items()}
                read_blob(blob_path(self.blob_dir, blob, f"segment {sid}"), fp, expected, crc,
                          hashes=members.get(sid))
            except BlobError as e:
                if not self._still_indexed("segments", "id", sid, blob):
                    checked -= 1
                    continue
                if self._sound_as_its_own(e, mid in models, blob, members.get(sid), crc,
                                          own_fps):
                    mismatched.setdefault(mid, []).append(blob)
                    continue
                if remove:
                    self._discard_segment(blob, str(e), e.damaged, then="", sid=sid)
                (removed if e.damaged else unreadable).append(_label(blob, f"segment {sid}"))
                if e.damaged:  # (one that cannot be read is kept: its chains stay whole)
                    damaged_segments.add(blob)
        orphans = self._remove_orphans(remove=remove)
        dangling = self._remove_dangling(damaged_segments, remove, own_fps)
        kept = [b for blobs in mismatched.values() for b in blobs]
        bad = {*removed, *unreadable, *dangling, *kept}  # (a damaged checkpoint may dangle too)
        return {"checked": checked, "ok": checked - len(bad),
                "removed": removed, "unreadable": unreadable, "dangling": dangling,
                "orphans": [name for name, _ in orphans],
                "orphans_freed": sum(size for _, size in orphans) if remove else 0,
                "mismatched_models": [{"id": mid, "name": names.get(mid), "blobs": len(blobs)}
                                      for mid, blobs in sorted(mismatched.items())]}

    def _sound_as_its_own(self, error: BlobError, known: bool, blob: str,
                          hashes: dict | None, crc: str | None, own_fps: set[str]) -> bool:
        """Whether a blob that failed only against its `models` row (`error.of_model`, the row
        there: `known`) is sound read as its own header says (model, tensors, shapes), its
        checksum and `hashes` checked; its header's fingerprint is added to `own_fps` then."""
        if not (error.of_model and known):
            return False
        path = blob_path(self.blob_dir, blob, "blob")
        try:
            fingerprint, shapes = own_identity(path)
            read_blob(path, fingerprint, shapes, crc, hashes=hashes)
        except BlobError:
            return False
        own_fps.add(fingerprint)
        return True

    def _remove_dangling(self, damaged: set[str], remove: bool,
                         own_fps: set[str] = frozenset()) -> list[str]:
        """The blobs of the checkpoints whose chain lacks a block (a block of a segment blob in
        `damaged` counts as lacking; a chain starts at a models row's fingerprint, or at one
        of `own_fps`, those of the blobs of an edited row): no lookup can resume from them,
        yet they count in the
        budget. Their rows, then blobs, are deleted unless `remove` is False. One transaction
        reads the chains and deletes: a running engine saves a checkpoint with its blocks, and
        evicts it before them, so none is taken for dangling while it is saved or evicted."""
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE" if remove else "BEGIN")
            parents = {h: parent for h, parent, blob in self.db.execute(
                "SELECT b.hash, b.parent, s.blob FROM blocks b JOIN segments s "
                "ON s.id = b.segment_id") if blob not in damaged}
            roots = {r[0] for r in self.db.execute("SELECT fingerprint FROM models")}
            roots |= own_fps
            ckpts = self.db.execute("SELECT hash, blob FROM checkpoints").fetchall()
            whole = _whole_chains([h for h, _ in ckpts], parents, roots)
            dangling = [(h, blob) for h, blob in ckpts if h not in whole]
            if remove:
                self.db.conn.executemany("DELETE FROM checkpoints WHERE hash = ?",
                                         [(h,) for h, _ in dangling])
        for _, blob in dangling if remove else []:
            self._unlink_blob(blob, unless_named=True)
        return [blob for _, blob in dangling]

    def _still_indexed(self, table: str, key: str, value: object, blob: str) -> bool:
        """Whether the row of `blob` (`key` = `value` in `table`) is still in the index: another
        process's engine evicts rows, then their blobs, while `verify` reads."""
        with self.db_lock:
            return self.db.execute(f"SELECT 1 FROM {table} WHERE {key} = ? AND blob IS ?",
                                   [value, blob]).fetchone() is not None
