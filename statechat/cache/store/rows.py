"""The rows of a save's blobs (the store's writer, writer.py): written in one SQLite
transaction once the blobs are on disk, a checkpoint's only with its whole chain indexed, and
none for a blob another process indexed first or deleted meanwhile (`cache clear`).

The blobs wait under their temporary names (which carry the writer's pid) until that
transaction renames them: a blob file under its final name with no row is then always an
orphan (a crash between rename and commit), never a save under way, however long the save took
(another process's clean-up, under the index's write lock, deletes it; freeing.py)."""

from __future__ import annotations

from pathlib import Path

from statechat.cache import index
from statechat.cache.blobs.write import publish
from statechat.cache.store.budget import record_budget
from statechat.cache.store.job import SaveJob
from statechat.cache.store.marks import ReuseMarks


class SaveRows(ReuseMarks):
    """StoreWriter's rows. Works on the store's db, db_lock, blob_dir, model_id, budget,
    budget_explicit and num_saved_checkpoints, and the marks of reuses (marks.py)."""

    def _insert_rows(self, job: SaveJob, new_blocks: list[tuple[str, str, int]],
                     seg: tuple[str, int, int, str, Path] | None,
                     ck: tuple[str, int, str, Path] | None, now: float) -> list[str]:
        """The rows of the blobs just written, in one transaction that first renames them from
        their temporary names (a row only after its blob),
        with the marks of reuses pending (`touch`). The checkpoint's row only if every block of
        its chain is on disk then, else (a checkpoint no lookup could resume) its blob is
        deleted; the chain's blocks missing (hex), none when it was whole.

        Another process on the same cache dir may have indexed the same checkpoint, or every
        block of the segment, since this job looked (both wrote them): then the rows of this
        write are ignored or hold nothing, and its blobs, which no row names, are deleted
        (rather than left for `cache verify` or `gc`). A blob of this write gone by then (its
        temporary file deleted by another process: an older version's `cache clear` deleted
        those older than a minute) gets no row: what it held counts as not saved, as rows
        deleted under the engine do."""
        marks, hits = self._take_touches()
        missing: list[str] = []
        unused: list[str | None] = []  # blob names of this write's own that no row names
        with self.db_lock, self.db.conn:
            self.db.execute("BEGIN IMMEDIATE")
            lost: list[str] = []  # (hex) what a blob gone since it was written held
            if seg is not None and not self._published(seg[0], seg[-1]):
                seg, lost = None, [h for h, _, _ in new_blocks]
            if ck is not None and not self._published(ck[0], ck[-1]):
                ck = None
                lost.append(job.ckpt_hash)
            if seg is not None:
                unused.append(self._insert_segment(seg, new_blocks, now))
            if job.chain_blocks:
                on_disk = index.blocks_present(self.db, job.chain_blocks)
                missing = [h for h in job.chain_blocks if h not in on_disk]
            is_saved = False  # (its row inserted: counted once the transaction commits)
            if ck is not None:
                unused.append(ck[0] if missing else self._insert_checkpoint(job, ck, now))
                is_saved = not missing and unused[-1] is None
            if job.chain:
                index.touch_chain(self.db, job.chain, now)
            self._mark_used(marks, hits)
            record_budget(self.db, self.budget, self.budget_explicit, now)  # (what gc keeps to)
            for name in filter(None, unused):  # (before the commit: nothing raises after it)
                (self.blob_dir / name).unlink(missing_ok=True)
        self._forget_touches(marks)
        self.num_saved_checkpoints += is_saved
        return list(dict.fromkeys(missing + lost))

    def _published(self, blob: str, temp: Path) -> bool:
        """(In _insert_rows' transaction) rename the blob written at `temp` to its name `blob`;
        False where its file is gone (deleted by an older version's `cache clear`)."""
        try:
            publish(temp, self.blob_dir / blob)
        except FileNotFoundError:
            return False
        return True

    def _insert_segment(self, seg: tuple[str, int, int, str],
                        new_blocks: list[tuple[str, str, int]], now: float) -> str | None:
        """(In _insert_rows' transaction) the segment's row and its blocks'; its blob's name
        when it ends up holding no block (another process indexed them all first)."""
        cur = self.db.execute(
            "INSERT INTO segments (model_id, blob, num_blocks, bytes, checksum, created, "
            "last_used) VALUES (?,?,?,?,?,?,?)",
            [self.model_id, seg[0], seg[1], seg[2], seg[3], now, now])
        seg_id = cur.lastrowid
        cur = self.db.conn.executemany(
            "INSERT OR IGNORE INTO blocks (hash, model_id, parent, position, segment_id, "
            "seg_index) VALUES (?,?,?,?,?,?)",
            [(h, self.model_id, parent, pos, seg_id, i)
             for i, (h, parent, pos) in enumerate(new_blocks)],
        )
        if cur.rowcount:
            return None
        self.db.execute("DELETE FROM segments WHERE id = ?", [seg_id])
        return seg[0]

    def _insert_checkpoint(self, job: SaveJob, ck: tuple[str, int, str],
                           now: float) -> str | None:
        """(In _insert_rows' transaction) the checkpoint's row; its blob's name when another
        process indexed the same checkpoint first."""
        cur = self.db.execute(
            "INSERT OR IGNORE INTO checkpoints (hash, model_id, num_tokens, blob, bytes, "
            "checksum, created, last_used, hits) VALUES (?,?,?,?,?,?,?,?,0)",
            [job.ckpt_hash, self.model_id, job.num_tokens, ck[0], ck[1], ck[2], now, now])
        return None if cur.rowcount else ck[0]
