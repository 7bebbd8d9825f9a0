"""`statechat cache verify`: every row's blob checked (present, readable, checksum, model,
shapes, and the block hashes its metadata lists against the rows that name it), orphan blob
files found, and the checkpoints that a damaged segment leaves without a whole chain."""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

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


class _Rows(NamedTuple):
    """The index's rows that `verify` checks, read at once."""

    models: dict  # model id -> (fingerprint, shapes)
    names: dict  # model id -> name
    ckpts: list  # (hash, model_id, blob, checksum)
    segs: list  # (id, model_id, blob, checksum, num_blocks)
    members: dict  # segment id -> {seg_index: hash} of its block rows


@dataclasses.dataclass
class _Tally:
    """What `verify` has found so far."""

    checked: int = 0
    removed: list[str] = dataclasses.field(default_factory=list)  # damaged blobs
    unreadable: list[str] = dataclasses.field(default_factory=list)  # kept
    damaged_segments: set[str] = dataclasses.field(default_factory=set)
    # model id -> its blobs, sound, that its row does not match; the fingerprints they give
    mismatched: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    own_fps: set[str] = dataclasses.field(default_factory=set)

    def failed(self, error: BlobError, label: str) -> None:
        (self.removed if error.damaged else self.unreadable).append(label)


def _report(tally: _Tally, names: dict, orphans: list, dangling: list[str],
            remove: bool) -> dict:
    """`verify`'s report (its docstring says what each key holds)."""
    kept = [b for blobs in tally.mismatched.values() for b in blobs]
    bad = {*tally.removed, *tally.unreadable, *dangling, *kept}  # (a damaged checkpoint may
    # dangle too)
    return {"checked": tally.checked, "ok": tally.checked - len(bad),
            "removed": tally.removed, "unreadable": tally.unreadable, "dangling": dangling,
            "orphans": [name for name, _ in orphans],
            "orphans_freed": sum(size for _, size in orphans) if remove else 0,
            "mismatched_models": [{"id": mid, "name": names.get(mid), "blobs": len(blobs)}
                                  for mid, blobs in sorted(tally.mismatched.items())]}


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
        rows = self._verify_rows()
        tally = _Tally()
        for h, mid, blob, crc in rows.ckpts:
            e = self._check_blob(tally, rows.models, mid, blob, crc, "ckpt", (),
                                 ("checkpoints", "hash", h), {0: h}, f"checkpoint {h[:12]}")
            if e is not None:
                if remove:
                    self._discard_checkpoint(h, blob, str(e), e.damaged, then="")
                tally.failed(e, _label(blob, f"checkpoint {h}"))
        for sid, mid, blob, crc, n in rows.segs:
            e = self._check_blob(tally, rows.models, mid, blob, crc, "block", (n,),
                                 ("segments", "id", sid), rows.members.get(sid), f"segment {sid}")
            if e is not None:
                if remove:
                    self._discard_segment(blob, str(e), e.damaged, then="", sid=sid)
                tally.failed(e, _label(blob, f"segment {sid}"))
                if e.damaged:  # (one that cannot be read is kept: its chains stay whole)
                    tally.damaged_segments.add(blob)
        orphans = self._remove_orphans(remove=remove)
        dangling = self._remove_dangling(tally.damaged_segments, remove, tally.own_fps)
        return _report(tally, rows.names, orphans, dangling, remove)

    def _verify_rows(self) -> _Rows:
        """The index's rows that `verify` checks, read at once (its integrity checked first)."""
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
        return _Rows(models, names, ckpts, segs, members)

    def _check_blob(self, tally: _Tally, models: dict, mid: int, blob: str, crc: str | None,
                    part: str, lead: tuple, row: tuple, hashes: dict | None,
                    what: str) -> BlobError | None:
        """Check one row's blob against its models row (`models[mid]`: its fingerprint, and its
        `part` shapes, each after `lead`) and `hashes`, counting it in `tally`. The error of a
        blob that fails, or None: for a sound blob, a row evicted meanwhile (`row`: its table,
        key and value; not counted) and a blob sound as its own header says (in `mismatched`)."""
        tally.checked += 1
        fp, shapes = models.get(mid, ("", {}))
        try:
            expected = {k: (*lead, *v) for k, v in shapes.get(part, {}).items()}
            read_blob(blob_path(self.blob_dir, blob, what), fp, expected, crc, hashes=hashes)
        except BlobError as e:
            if not self._still_indexed(*row, blob):
                tally.checked -= 1  # (evicted meanwhile, by a running engine: not damage)
                return None
            if self._sound_as_its_own(e, mid in models, blob, hashes, crc, tally.own_fps):
                tally.mismatched.setdefault(mid, []).append(blob)
                return None
            return e
        return None

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
