"""Crash safety: writers killed with SIGKILL at random moments (20 trials) leave a cache that
`verify` reports clean, and the next run's outputs are correct."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from statechat.cache.store import open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import ROOT, subprocess_env


def test_sigkill_while_writing_leaves_a_clean_cache(tiny_dirs, tmp_path):
    path = tiny_dirs["qwen3_5_text"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist()
               for n in (150, 260, 330, 200, 420)]
    req = json.dumps({"prompts": prompts, "max_tokens": 70, "kill_trials": 20})
    env = subprocess_env()
    out = subprocess.run([sys.executable, "-m", "tests.cache.worker", str(path), str(tmp_path)],
                         input=req, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count('"killed"') == 20

    store = open_store(tmp_path)
    assert store.stats()["num_checkpoints"] > 0, "the writers never got a checkpoint on disk"
    report = store.verify()
    assert report["removed"] == [], report

    loaded = load_model(path, dtype=torch.float32)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    cached = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    got = cached.generate(prompts, params)
    want = plain.generate(prompts, params)
    cached.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert any(g.num_cached_tokens > 0 for g in got)


def test_a_crashed_writer_s_leftover_blobs_go_at_the_next_start(tiny_dirs, tmp_path):
    """A writer killed mid-save leaves a temporary blob (killed before its rename) or an orphan
    (killed between the rename and its row): files outside the budget, which stayed until
    someone ran `statechat cache gc` or `verify`, however many crashes there were. The next
    engine's writer deletes them as it starts; a young one, another process's save under way
    on the same cache dir, is left alone."""
    import os

    blobs = tmp_path / "blobs"
    old = [blobs / "kv" / f"{'ab' * 16}.safetensors",
           blobs / "ckpt" / "cd" / f"{'cd' * 32}-{'ef' * 4}.safetensors.{'01' * 16}.tmp"]
    young = blobs / "kv" / f"{'12' * 16}.safetensors.{'34' * 16}.tmp"
    for f in [*old, young]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 100)
    for f in old:
        os.utime(f, (1_000_000_000, 1_000_000_000))
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                       loaded=load_model(path, dtype=torch.float32))
    engine.close()
    assert [f.exists() for f in old] == [False, False]
    assert young.exists()


def test_a_temporary_blob_is_kept_while_its_writer_lives(tmp_path, monkeypatch):
    """Past the minute's grace, a temporary blob whose writer (the pid in its name) has exited
    is a leftover, and the start's sweep and `cache clear` delete it; one whose writer still
    runs is a save under way, and both keep it (a day at most: a pid can be reused)."""
    import os
    import subprocess
    import sys
    import time

    from statechat.cache.store import open_store

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead, alive = int(gone.stdout), os.getpid()
    blobs = tmp_path / "blobs" / "kv"
    blobs.mkdir(parents=True)
    names = {pid: blobs / f"{'ab' * 16}.safetensors.{pid}.{'01' * 16}.tmp"
             for pid in (dead, alive)}
    stale = blobs / f"{'cd' * 16}.safetensors.{alive}.{'02' * 16}.tmp"
    for f in [*names.values(), stale]:
        f.write_bytes(b"x" * 10)  # (written now, by this process: ten minutes old below)
    os.utime(stale, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    store = open_store(tmp_path)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 600)
    store.sweep_leftovers()
    assert [names[dead].exists(), names[alive].exists(), stale.exists()] == [False, True, False]
    names[dead].write_bytes(b"x" * 10)
    assert store.clear() == 10
    assert names[alive].exists() and not names[dead].exists()
    store.close()


def test_a_temporary_blob_of_a_reused_pid_is_a_leftover(tmp_path):
    """A server killed mid-save (an out-of-memory kill) and restarted in its container has its
    predecessor's pid (often 1): the temporary blobs the dead one left carry a live pid, and
    were kept a day, outside the budget, by the sweep and by `cache clear` alike. A live pid
    is their writer only if its process started before they were written."""
    import os
    import time

    from statechat.cache.store import open_store

    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc: a process's start time cannot be told here")
    blobs = tmp_path / "blobs" / "kv"
    blobs.mkdir(parents=True)
    left = [blobs / f"{c * 32}.safetensors.{os.getpid()}.{'01' * 16}.tmp" for c in "ab"]
    for f in left:  # (three hours old: written before this process started)
        f.write_bytes(b"x" * 10)
        os.utime(f, (time.time() - 3 * 3600, time.time() - 3 * 3600))
    store = open_store(tmp_path)
    store.sweep_leftovers()
    assert not left[0].exists()
    left[1].write_bytes(b"x" * 10)
    os.utime(left[1], (time.time() - 3 * 3600, time.time() - 3 * 3600))
    assert store.clear() == 10
    store.close()


def test_a_start_with_nothing_to_sweep_does_not_wait_for_the_write_lock(tmp_path):
    """The sweep deletes under the index's write lock (no save is then between its rename and
    its rows); with nothing to sweep it takes no lock, so a start does not wait SQLite's 30 s
    behind another process's transaction (a `sqlite3` shell inside BEGIN)."""
    import sqlite3
    import time

    from statechat.cache.store import open_store

    store = open_store(tmp_path)
    shell = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    try:
        start = time.monotonic()
        store.sweep_leftovers()
        assert time.monotonic() - start < 5
    finally:
        shell.execute("ROLLBACK")
        shell.close()
        store.close()
