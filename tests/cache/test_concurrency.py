"""Two processes writing to and reading from one cache dir at the same time lose nothing and
corrupt nothing: both get the no-cache tokens, the index verifies clean, and every checkpoint
either wrote is usable afterwards."""

from __future__ import annotations

import sqlite3
import threading
import time
from types import SimpleNamespace

import torch

from statechat.cache import index
from statechat.cache.store import open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.cache.test_persistence import MAX_TOKENS, run_worker


def test_two_processes_share_one_cache_dir(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    gen = torch.Generator().manual_seed(8)
    shared = torch.randint(0, 300, (260,), generator=gen).tolist()
    prompts = [shared[: 150 + 20 * i] + torch.randint(0, 300, (30,), generator=gen).tolist()
               for i in range(6)]
    results: dict[int, list[dict]] = {}

    def worker(n: int) -> None:
        order = prompts if n == 0 else prompts[::-1]
        results[n] = run_worker(path, tmp_path, order)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    loaded = load_model(path, dtype=torch.float32)
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [r["tokens"] for r in results[0]] == want
    assert [r["tokens"] for r in results[1]] == want[::-1]

    store = open_store(tmp_path)
    report = store.verify()
    assert report["removed"] == [] and report["checked"] > 0
    # a third process finds what both wrote
    third = run_worker(path, tmp_path, prompts)
    assert [r["tokens"] for r in third] == want
    assert all(r["cached"] > 0 for r in third)


def test_a_save_raced_by_another_process_leaves_no_orphan_blob(tmp_path, monkeypatch):
    """Two processes that save the same checkpoint and blocks at once both write blobs; the one
    that indexes second finds its rows ignored (INSERT OR IGNORE) and deletes its own blobs,
    and the segment row that would name no block, instead of leaving them for `cache verify`."""
    from statechat.cache import index
    from tests.cache.test_device import attached, save

    first, second = attached(tmp_path, "cpu", 0), attached(tmp_path, "cpu", 0)
    save(first, "cpu")
    # the second looked before the first's rows were in: it found neither blocks nor checkpoint
    monkeypatch.setattr(index, "blocks_present", lambda db, hashes: set())
    monkeypatch.setattr(index, "checkpoints_present", lambda db, hashes: [])
    save(second, "cpu")
    monkeypatch.undo()
    assert second._remove_orphans(min_age_s=0, remove=False) == []
    assert second.db.execute("SELECT count(*) FROM segments").fetchone()[0] == 1
    assert second.verify()["removed"] == []
    first.close()
    second.close()


def test_a_slow_save_s_blobs_are_not_swept_by_another_process_s_start(tmp_path, monkeypatch):
    """Another process's writer, as it starts, sweeps blob files no row names that are older
    than the grace period: a save whose rows came more than that after its blob was written (a
    writer stalled, a slow disk) lost its blobs to it, and the checkpoint was not indexed. A
    temporary file carries its writer's pid (kept while that process lives), and the blob is
    renamed to its final name in the transaction that writes its row."""

    from statechat.cache.store import maintenance, writer
    from tests.cache.test_device import HASHES, attached, save

    first, second = attached(tmp_path, "cpu", 0), open_store(tmp_path)
    real = writer.write_blob

    def stalled(path, *args, **kwargs):  # the other's start an hour after the blob's write
        out = real(path, *args, **kwargs)
        # (not its files' times put back: this process wrote them after it began; and the
        # sweep's clock alone moved: time.time itself, moved in this writer thread, made the
        # main thread's flush see its deadline pass and return before the save was done)
        an_hour_on = SimpleNamespace(time=lambda: time.time() + 3600)
        with monkeypatch.context() as later:
            later.setattr(maintenance, "time", an_hour_on)
            second.sweep_leftovers()
        return out

    monkeypatch.setattr(writer, "write_blob", stalled)
    save(first, "cpu")
    monkeypatch.undo()
    assert first.db.execute("SELECT count(*) FROM checkpoints").fetchone()[0] == 1
    assert first.load_checkpoint(HASHES[-1]) is not None
    report = second.verify()
    assert report["removed"] == [] and report["orphans"] == [] and report["checked"] == 2
    first.close()
    second.close()


class Rows(list):
    def fetchone(self):
        return self[0] if self else None


class MigratedBetweenReads:
    """A connection after whose first read of the file's tables another connection makes the
    index (its migration committed): the moment another process's start can land on."""

    def __init__(self, conn: sqlite3.Connection, path) -> None:
        self.conn, self.path, self.done = conn, path, False

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def execute(self, sql: str, *args) -> Rows:
        rows = Rows(self.conn.execute(sql, *args).fetchall())
        if "sqlite_master" in sql and not self.done:
            self.done = True
            index.connect(self.path).conn.close()
        return rows


def test_an_index_made_by_another_process_between_two_reads_is_taken_as_ours(tmp_path):
    """Two processes opening a new cache dir at once: the index one of them makes (tables and
    schema version in one transaction) while the other reads the file was called another
    program's (its version read after, its tables before, the commit), and that engine failed
    to start."""
    path = tmp_path / "index.db"
    sqlite3.connect(path).execute("PRAGMA journal_mode = WAL").connection.close()
    conn = sqlite3.connect(path, isolation_level=None)
    racing = MigratedBetweenReads(conn, path)
    index.refuse_foreign(racing, path)  # raised ConfigError: "a schema version of another
    assert racing.done  # program's, 1"
    index.refuse_foreign(conn, path)  # (and the index it made is one)
    conn.close()
