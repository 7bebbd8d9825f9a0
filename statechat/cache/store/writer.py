"""The store's write-behind: the bounded queue `save` puts jobs in, and the writer
thread that keeps them in the host tier and persists them (blobs, then rows in one SQLite
transaction).

Writes never block the caller: a bounded queue drops (and counts) jobs it cannot take. A
reuse's mark of its rows as used (`touch`, marks.py) takes no room in it: the marks are kept
apart, the latest per checkpoint, and written all at once in the writer's next transaction. The
writer holds back while the engine says it is launching work (`engine_busy`), for at most
MAX_DEFER_S per job: its Python steps would otherwise take the GIL from the kernel launches of
a prefill. A save copies into the host tier (arena.py) and pins nothing. Its host copies are
numpy's, on this thread alone (hostcopy.py): a torch op would start an OpenMP team here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from statechat.cache import hostcopy, index, sqlite_files
from statechat.cache.blobs.encoding import BlobMeta, ckpt_blob_name, kv_blob_name, temp_name
from statechat.cache.blobs.write import write_blob
from statechat.cache.store.budget import record_budget
from statechat.cache.store.job import SaveJob
from statechat.cache.store.rows import SaveRows

log = logging.getLogger("statechat.cache")
MAX_DEFER_S = 0.2  # the longest the writer waits for the engine over one job
WRITER_JOIN_S = 10  # how long a stop waits for the writer's last job, once the queue is flushed
TOUCH_WAIT_S = 0.1  # the longest an idle writer leaves reuses' marks (`touch`) unwritten


class StoreWriter(SaveRows):
    """StateStore's writes. Works on the store's state (state_store.py): queue, writer,
    pending_bytes, pending_lock, max_pending_bytes, touched, hit_counts, errors, failed_saves,
    failed, engine_idle, _defer_left, and host, copy_stream, db, db_lock, fingerprint,
    blob_dir, budget and budget_explicit (every write transaction records the budget it evicts
    down to: budget.py); a save's rows are written by rows.py, `evict_to` comes from
    maintenance.py, `give_up` from state_store.py."""

    def _start_writer(self) -> None:
        """Start the writer thread (once a model is attached)."""
        self.writer = threading.Thread(target=self._write_loop, name="statechat-cache-writer",
                                       daemon=True)
        self.writer.start()

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
            if (nbytes > self.max_pending_bytes or self.writer is None
                    or time.monotonic() >= deadline):
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

    def flush(self, timeout: float = 60.0, stall_s: float = float("inf")) -> None:
        """Wait until every queued job, and every reuse's mark (`touch`), is on disk (tests,
        shutdown), for at most `timeout`, and at most `stall_s` while no job finishes (a writer
        stuck behind another process's lock is not waited out twice as an engine closes)."""
        deadline = time.time() + timeout
        left, moved = self.queue.unfinished_tasks, time.time()
        while ((self.queue.unfinished_tasks or ((self.touched or self.hit_counts)
                                                and self.writer is not None
                                                and self.failed is None))
               and time.time() < deadline):
            if self.queue.unfinished_tasks != left:
                left, moved = self.queue.unfinished_tasks, time.time()
            elif time.time() - moved > stall_s:
                return
            time.sleep(0.005)

    def stop_writer(self) -> bool:
        """Flush the queue and stop the writer thread (the index stays open); whether it stopped
        (False: a write still under way after the waits, its thread left to finish it)."""
        if self.writer is not None:
            self.flush()
            self.queue.put(None)
            self.writer.join(timeout=WRITER_JOIN_S)
            if self.writer.is_alive():
                return False
            self.writer = None
        self.failed_saves.close()  # (the count of the failed saves not shown yet)
        return True

    def _write_loop(self) -> None:
        self.sweep_leftovers()  # (a crashed writer's temporary and orphan blobs, once a start)
        while True:
            try:
                job = self.queue.get(timeout=TOUCH_WAIT_S)
            except queue.Empty:  # (idle: the marks of reuses meanwhile)
                self._write_touches()
                continue
            try:
                if job is None:
                    self._write_touches()
                    return
                if self.failed is None:
                    self._write(job)
                elif job.ready is not None:  # (the disk tier is off: dropped, once its
                    job.ready()  # snapshots are complete)
            except Exception as e:  # noqa: BLE001 - a failed write must never stop generation
                self._write_failed(e)
                if job is not None:  # (what it was to save may be missing)
                    self._report_unsaved(job, [b[0] for b in job.blocks] + [job.ckpt_hash or ""],
                                         retry=False)
            finally:
                if job is not None:
                    with self.pending_lock:
                        self.pending_bytes -= job.queued_bytes
                self.queue.task_done()

    def _write_failed(self, error: Exception) -> None:
        """A job failed: an unusable index turns the disk tier off (`give_up`); anything else
        (a lock another process held past the busy timeout, a full disk) costs that job alone,
        counted in `errors` and told (failures.py)."""
        if sqlite_files.is_unusable(error):
            self.give_up(error)
            return
        self.errors += 1
        self.failed_saves.failed(error)  # (one line per cause, then a count)

    def _write_touches(self) -> None:
        """Write the pending marks of reuses in one transaction; dropped when it fails (they
        are best effort), or when the disk tier is off."""
        if not self.touched and not self.hit_counts:
            return
        marks, hits = self._take_touches()
        try:
            if self.failed is None:
                self._defer_left = MAX_DEFER_S
                self._pause()
                with self.db_lock, self.db.conn:
                    self.db.execute("BEGIN IMMEDIATE")
                    self._mark_used(marks, hits)
                    record_budget(self.db, self.budget, self.budget_explicit, time.time())
        except Exception as e:  # noqa: BLE001 - a failed write must never stop generation
            self._write_failed(e)
        finally:
            self._forget_touches(marks)

    def _write(self, job: SaveJob) -> None:
        """Keep in the host tier, and write as blobs, what of the job the disk lacks (its blocks
        all, where it lacks any), then their rows in one transaction (marking the job's chain
        used), then evict down to the budget."""
        self._defer_left = MAX_DEFER_S
        self._pause()
        if job.ready is not None:
            job.ready()
        hashes = [b[0] for b in job.blocks]
        with self.db_lock:
            on_disk = index.blocks_present(self.db, hashes)
            have_ckpt = bool(job.ckpt_hash) and bool(
                index.checkpoints_present(self.db, [job.ckpt_hash]))
        rows = [i for i, b in enumerate(job.blocks) if b[0] not in on_disk]
        # what the disk holds already (a prefix computed again: a reply regenerated after a
        # restart) is not copied to host memory: its snapshot is dropped, its rows marked used
        if have_ckpt:
            job.ckpt = None
        if not rows:
            hashes, job.block_tensors = [], {}
        job.ckpt, job.block_tensors = self.host.keep(job.ckpt_hash, job.ckpt, hashes,
                                                     job.block_tensors, self.copy_stream)
        new_blocks = [job.blocks[i] for i in rows]
        now = time.time()
        seg = ck = None
        try:  # (a save that fails before its rows, a full disk's, deletes the blobs it wrote)
            seg = self._write_segment(job, rows) if new_blocks else None
            if job.ckpt is not None and job.ckpt_hash and not have_ckpt:
                ck = self._write_checkpoint(job)
            self._pause()
            missing = self._insert_rows(job, new_blocks, seg, ck, now)
        except BaseException:  # (its transaction rolled back: no row names them)
            for blob in filter(None, (seg, ck)):
                (self.blob_dir / blob[0]).unlink(missing_ok=True)
                blob[-1].unlink(missing_ok=True)  # (its temporary file, where not renamed)
            raise
        if missing:  # (its checkpoint was not indexed, and its blob is not kept)
            self._report_unsaved(job, missing + [job.chain or ""], retry=True)
        self.evict_to(self.budget)

    def _report_unsaved(self, job: SaveJob, hashes: list[str], retry: bool) -> None:
        """Tell the engine (`job.unsaved`) which blocks and checkpoint (hex) it took to be on
        disk, or queued, the disk may lack after `job`; `retry`: the job's checkpoint is worth
        queueing again (its chain was found incomplete: rows deleted under the engine, by
        `cache clear` or an eviction), else the job failed (a full disk)."""
        if job.unsaved is not None:
            job.unsaved([h for h in hashes if h], retry)

    def _write_segment(self, job: SaveJob, rows: list[int]) -> tuple[str, int, int, str, Path]:
        """Write the blocks at `rows` of the job as one segment blob, under its temporary name
        (renamed with its row, rows.py): (blob, num_blocks, bytes, checksum, temporary file)."""
        new_blocks = [job.blocks[i] for i in rows]
        tensors = job.block_tensors
        if len(rows) < len(job.blocks):
            tensors = {n: hostcopy.take_rows(t, rows) for n, t in tensors.items()}
        blob = kv_blob_name()
        block_size = next(iter(tensors.values())).shape[1]
        hashes = [b[0] for b in new_blocks]
        meta = BlobMeta(self.fingerprint, len(new_blocks) * block_size, hashes, "kv")
        temp = self.blob_dir / temp_name(blob)
        size, crc = write_blob(self.blob_dir / blob, tensors, meta, self._pause, temp=temp)
        return blob, len(new_blocks), size, crc, temp

    def _write_checkpoint(self, job: SaveJob) -> tuple[str, int, str, Path]:
        """Write the job's checkpoint as a blob under its temporary name: (blob, bytes,
        checksum, temporary file)."""
        blob = ckpt_blob_name(job.ckpt_hash)
        meta = BlobMeta(self.fingerprint, job.num_tokens, [job.ckpt_hash], "ckpt")
        temp = self.blob_dir / temp_name(blob)
        size, crc = write_blob(self.blob_dir / blob, job.ckpt, meta, self._pause, temp=temp)
        return blob, size, crc, temp
