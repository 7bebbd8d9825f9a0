"""A full write-behind queue never stalls generation: the checkpoint is dropped, counted and
reported with one warning line, and the tokens are unchanged."""

from __future__ import annotations

import gc
import logging
import time
import weakref

import torch

from statechat.cache.store import open_store
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model


def test_full_queue_drops_and_reports(tiny_dirs, tmp_path, caplog):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    store = engine.store
    store.max_pending_bytes = 0  # nothing fits: every save is refused
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        out = engine.generate([prompt], params)[0]
    engine.close()
    assert out.token_ids == plain.generate([prompt], params)[0].token_ids
    assert store.dropped >= 1
    assert any("write queue is full" in r.getMessage() for r in caplog.records)
    assert open_store(tmp_path, read_only=True).stats()["num_checkpoints"] == 0


def test_writer_holds_back_while_the_engine_launches(tiny_dirs, tmp_path, monkeypatch):
    """While the engine says it is launching a step, the writer starts nothing (it would take
    the GIL from the launches); once the engine waits or is idle, the queued saves land."""
    from statechat.cache.store import writer

    monkeypatch.setattr(writer, "MAX_DEFER_S", 30.0)
    engine = cached_engine(tiny_dirs, tmp_path)
    before = saved_after(engine, seed=2)
    hold(engine.store)
    engine.generate([prompt(3)], SamplingParams(max_tokens=1, ignore_eos=True))
    assert not engine.store.engine_idle.is_set()
    time.sleep(0.3)
    assert engine.store.stats()["num_checkpoints"] == before  # queued, held back
    engine.store.engine_busy(False)
    engine.store.flush()
    assert engine.store.stats()["num_checkpoints"] > before
    engine.close()


def test_a_busy_engine_delays_writes_but_does_not_stop_them(tiny_dirs, tmp_path, monkeypatch):
    """An engine that stays busy (a long run of prefill chunks) delays a job by at most
    MAX_DEFER_S in all; the rows land while it is still busy."""
    from statechat.cache.store import writer

    monkeypatch.setattr(writer, "MAX_DEFER_S", 0.05)
    engine = cached_engine(tiny_dirs, tmp_path)
    before = saved_after(engine, seed=4)
    hold(engine.store)
    engine.generate([prompt(5)], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.store.flush(timeout=10)
    assert not engine.store.engine_idle.is_set()
    assert engine.store.stats()["num_checkpoints"] > before
    engine.store.engine_busy(False)
    engine.close()


def test_the_writer_holds_back_during_admission(tiny_dirs, tmp_path):
    """A request's admission (its lookup and a restore's disk reads) counts as the engine's
    work: the writer does not share the disk with the reads."""
    engine = cached_engine(tiny_dirs, tmp_path)
    seen = []
    schedule = engine.scheduler.schedule

    def watched():
        seen.append(engine.store.engine_idle.is_set())
        return schedule()

    engine.scheduler.schedule = watched
    engine.generate([prompt(9)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert seen and not any(seen)  # busy whenever the scheduler admits or schedules
    assert engine.store.engine_idle.is_set()  # and idle again once the request ended
    engine.close()


def test_the_engine_is_idle_after_every_way_a_request_ends(tiny_dirs, tmp_path):
    """A finished request, a stream closed early and an abort in mid-prefill all leave the
    store's writer free to run."""
    engine = cached_engine(tiny_dirs, tmp_path, max_num_batched_tokens=64)
    engine.generate([prompt(6)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.store.engine_idle.is_set()
    events = engine.stream(prompt(7), SamplingParams(max_tokens=8, ignore_eos=True))
    next(events)
    events.close()
    assert engine.store.engine_idle.is_set()
    seq = engine.add_request(prompt(8), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # one 64-token chunk of 200: nothing sampled, still busy
    assert not engine.store.engine_idle.is_set()
    engine.abort(seq)
    assert engine.store.engine_idle.is_set()
    engine.close()


def test_a_deleted_engine_is_freed_at_once(tiny_dirs, tmp_path):
    """No reference cycle keeps an engine (and its pools) alive until a garbage collection."""
    engine = cached_engine(tiny_dirs, tmp_path)
    engine.generate([prompt(9)], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.close()
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None
    finally:
        gc.enable()


def cached_engine(tiny_dirs, cache_dir, **config) -> LLMEngine:
    path = tiny_dirs["qwen3_5_text"]
    return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir, **config),
                     loaded=load_model(path, dtype=torch.float32))


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(seed)).tolist()


def saved_after(engine: LLMEngine, seed: int) -> int:
    """Checkpoints on disk after one request and a flush (an idle engine writes at once)."""
    engine.generate([prompt(seed)], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.store.flush()
    assert engine.store.stats()["num_checkpoints"] >= 1
    return engine.store.stats()["num_checkpoints"]


def hold(store) -> None:
    """Make store.save mark the engine busy first, as if the next step were already being
    launched when a job is queued (the engine itself marks idle when it awaits tokens)."""
    save = store.save

    def busy_save(job):
        store.engine_busy(True)
        return save(job)

    store.save = busy_save


def test_checkpoints_turned_away_by_a_full_queue_are_saved_later(tiny_dirs, tmp_path, caplog):
    """A burst of checkpoints past the queue's room waits in the device tier and is saved when
    the queue drains (or the engine closes): none is lost while the device tier holds it, and a
    new process resumes every prompt at its end (a batch of 200 requests once lost 40%). The
    prompts share their first two blocks, computed at once by all: the sequences whose copies
    were not the ones registered still have their checkpoints saved (from the registered
    copies)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    store = engine.store
    store.queue.maxsize = 1  # (room for one job at a time)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 300, (128,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 300, (70,), generator=gen).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="statechat.cache"):
        engine.generate(prompts, params)
        engine.close()
    assert engine.prefix.deferrals >= 1 and store.dropped == 0
    said = [r.getMessage() for r in caplog.records if "statechat cache" in r.getMessage()]
    assert len(said) == 1 and "write queue is full; new checkpoints wait" in said[0], said
    again = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path), loaded=loaded)
    outs = again.generate(prompts, params)
    again.close()
    assert [o.num_cached_tokens for o in outs] == [192] * 6


def test_a_reuse_s_mark_never_waits_for_a_full_queue(tmp_path):
    """A reuse marks its rows as used (`touch`) at once, with the write queue full: the mark
    is kept apart for the writer, never waits for room, and takes none."""
    import threading

    from statechat.cache.store import StateStore

    store = StateStore(tmp_path, queue_size=1)  # (no writer thread: nothing empties it)
    store.queue.put_nowait(None)  # (full)
    done, took = threading.Event(), []

    def admit_twice():
        store.touch("ab" * 32)
        t = time.perf_counter()
        store.touch("cd" * 32)
        took.append(time.perf_counter() - t)
        done.set()

    threading.Thread(target=admit_twice, daemon=True).start()
    assert done.wait(5) and took[0] < 1  # (waiting for room would be for ever: no writer)
    assert store.queue.qsize() == 1 and set(store.touched) == {"ab" * 32, "cd" * 32}
    store.db.conn.close()


def test_reuses_marked_while_the_engine_is_busy_leave_saves_their_room(tiny_dirs, tmp_path,
                                                                       monkeypatch):
    """A burst of reuses (each marks its rows as used) while the engine launches work takes no
    room in the write queue from saves, and the marks land once the writer gets to them."""
    from statechat.cache.store import writer

    monkeypatch.setattr(writer, "MAX_DEFER_S", 30.0)
    engine = cached_engine(tiny_dirs, tmp_path)
    saved_after(engine, seed=6)
    store = engine.store
    with store.db_lock:
        before = dict(store.db.execute("SELECT hash, last_used FROM checkpoints").fetchall())
    time.sleep(0.05)
    store.engine_busy(True)
    for _ in range(100):
        for h in before:
            store.touch(h)
    assert store.has_room(1)  # (the marks filled the queue: saves were turned away)
    store.engine_busy(False)
    store.flush()
    with store.db_lock:
        after = dict(store.db.execute("SELECT hash, last_used FROM checkpoints").fetchall())
    engine.close()
    assert all(after[h] > before[h] for h in before)
