"""The disk tier survives restarts and gives exactly the no-cache tokens.

A conversation is run in one process; a new process on the same cache dir, given the
conversation with its last user message edited, reuses exactly up to the nearest checkpoint
(from disk) and produces the same greedy tokens as an engine with no cache. Then randomised
conversation trees (edits at random turns, regenerations, continuations) across several
process restarts always match no-cache outputs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial

import pytest
import torch

from statechat.cache.hashing import chain_hashes
from statechat.cache.store import open_store
from statechat.chat.template import render
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import ROOT, PolicyModel, subprocess_env

MAX_TOKENS = 16
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel", "disk"]


def run_worker(model, cache_dir, prompts: list[list[int]]) -> list[dict]:
    """Run prompts in a fresh process on `cache_dir`; its per-request results."""
    req = json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS})
    env = subprocess_env()
    out = subprocess.run([sys.executable, "-m", "tests.cache.worker", str(model), str(cache_dir)],
                         input=req, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def plain(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    return path, LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                           loaded=loaded)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def no_cache_tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_restart_edit_last_message_reuses_disk_checkpoint(plain, tmp_path):
    path, engine = plain
    tok = engine.tokenizer
    rng = random.Random(1)
    policy = PolicyModel(interval=2)
    messages = [{"role": "system", "content": words(rng, 40)}]
    prompts = []
    for _ in range(3):  # a conversation of three turns, in process 1
        messages.append({"role": "user", "content": words(rng, 50)})
        prompts.append(render(tok, messages))
        out = no_cache_tokens(engine, [prompts[-1]])[0]
        messages.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
    first = run_worker(path, tmp_path, prompts)
    for p, r in zip(prompts, first):
        policy.record(p, r["tokens"])
    edited = messages[:-2] + [{"role": "user", "content": words(rng, 45)}]
    prompt = render(tok, edited)
    second = run_worker(path, tmp_path, [prompt])[0]  # process 2, same cache dir
    want = policy.expected_reuse(prompt)
    assert want > 0
    assert second["cached"] == want
    assert second["reused_from"] == "disk"
    assert second["plan"]["choice"] == "load"
    assert second["tokens"] == no_cache_tokens(engine, [prompt])[0]


def test_random_forks_across_restarts_match_no_cache(plain, tmp_path):
    """50 conversation trees over 5 process lifetimes; every output equals the no-cache one."""
    path, engine = plain
    tok = engine.tokenizer
    rng = random.Random(7)
    trees = [[{"role": "system", "content": words(rng, rng.randint(20, 60))}] for _ in range(50)]
    policy = PolicyModel(interval=2)
    hits = 0
    for session in range(5):
        prompts = []
        for tree in trees[session * 10 : (session + 1) * 10]:
            for _ in range(2):
                tree.append({"role": "user", "content": words(rng, rng.randint(10, 70))})
                tree.append({"role": "assistant", "content": words(rng, rng.randint(5, 30))})
            prompts.append(render(tok, tree[:-1]))  # the last turn as asked
        # forks of earlier sessions' trees: edits, regenerations and continuations
        for tree in rng.sample(trees[: (session + 1) * 10], 10):
            kind, turn = rng.choice(["edit", "regen", "cont"]), rng.randrange(1, len(tree), 2)
            if kind == "edit":
                branch = tree[:turn] + [{"role": "user", "content": words(rng, 40)}]
                prompts.append(render(tok, branch))
            elif kind == "regen":
                prompts.append(render(tok, tree[: turn + 1]))
            else:
                end = min(turn + 2, len(tree))
                prompts.append(render(tok, tree[:end],
                                      add_generation_prompt=tree[end - 1]["role"] == "user"))
        with ThreadPoolExecutor(1) as pool:  # (the no-cache tokens made while the process runs)
            wanted = pool.submit(no_cache_tokens, engine, prompts)
            results = run_worker(path, tmp_path, prompts)
            want = wanted.result()
        for p, r, w in zip(prompts, results, want):
            assert r["tokens"] == w
            if r["plan"] and r["plan"]["choice"] == "load":
                assert r["cached"] == policy.expected_reuse(p)
                hits += 1
            policy.record(p, r["tokens"])
    assert hits >= 30, f"only {hits} of 100 requests resumed from a checkpoint"


PROMPT = list(range(5, 5 + 200))  # 3 full blocks: checkpoint at 192, the last boundary
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def on_cache_dir(plain, cache_dir) -> LLMEngine:
    """An engine of the plain fixture's model on cache_dir (a new one per process start)."""
    path, engine = plain
    return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir),
                     loaded=engine.loaded)


def saved_prompt(plain, cache_dir) -> LLMEngine:
    """Run PROMPT on cache_dir and close the engine (its saves written): the first process."""
    first = on_cache_dir(plain, cache_dir)
    first.generate([PROMPT], PARAMS)
    first.close()
    return first


def test_recomputing_a_stored_prefix_queues_nothing_stored(plain, tmp_path):
    """After a restart, a prefix the store chose to recompute is not copied or queued again:
    its blocks and its checkpoint are on disk already."""
    _, engine = plain
    saved_prompt(plain, tmp_path)
    assert open_store(tmp_path, read_only=True).stats()["num_checkpoints"] >= 1
    second = on_cache_dir(plain, tmp_path)
    second.prefix.cost.prefill_s_per_token = 1e-12  # recomputing is free: the plan recomputes
    queued = []
    save = second.store.save
    second.store.save = lambda job: queued.append(job) or save(job)
    edited = PROMPT + [7, 8, 9]  # the same 3 blocks, so the same checkpoint at 192
    out = second.generate([edited], PARAMS)[0]
    second.close()
    assert out.num_cached_tokens == 0 and out.cache_plan["choice"] == "recompute"
    # the plan still reports what loading would have cost, and for how many tokens
    assert out.cache_plan["candidate_tokens"] == 192 and out.cache_plan["predicted_load_s"] > 0
    assert queued == []
    assert out.token_ids == no_cache_tokens(engine, [edited])[0][:4]


def test_a_plan_that_cannot_pay_asks_the_index_only_for_checkpoints(plain, tmp_path, monkeypatch):
    """When loading even at the best disk rate cannot beat recomputing, the plan does not ask
    the index (or the page cache) about the disk's blocks before the request computes: it
    reports its load time as a lower bound, and learns which blocks are on disk on a pool
    thread (nothing already stored is queued again)."""
    from statechat.cache import index
    from statechat.cache.store import lookup, reads

    saved_prompt(plain, tmp_path)
    second = on_cache_dir(plain, tmp_path)
    second.prefix.cost.prefill_s_per_token = 1e-12
    asked, present = [], index.blocks_present
    monkeypatch.setattr(index, "blocks_present", lambda db, hashes: asked.append(
        threading.current_thread() is threading.main_thread()) or present(db, hashes))
    for module in (lookup, reads):  # a plan's shares; the start's rate sample
        monkeypatch.setattr(module, "resident_fraction",
                            lambda path: pytest.fail("asked the page cache"))
    ahead = second.store.blocks_on_disk_ahead
    checks = []  # finished before the request's first step (the test does not race the pool)
    monkeypatch.setattr(second.store, "blocks_on_disk_ahead",
                        lambda hashes: checks.append(ahead(hashes)) or wait(checks) and checks[-1])
    monkeypatch.setattr(second.store, "save", lambda job: pytest.fail("queued a stored prefix"))
    out = second.generate([PROMPT + [7, 8, 9]], PARAMS)[0]
    second.close()
    assert out.cache_plan["choice"] == "recompute" and out.cache_plan["load_is_lower_bound"]
    assert out.cache_plan["candidate_tokens"] == 192 and "disk_resident" not in out.cache_plan
    assert asked == [False] and len(checks) == 1  # once, off the engine's thread


def test_persisting_never_waits_for_a_check_of_the_disk(plain, tmp_path):
    """A check of which blocks are on disk that has not finished is not waited for: the step
    persists its checkpoint as if none were (the writer skips rows already there), and applies
    the check at a later step; a failed check is logged, not raised."""
    from concurrent.futures import Future

    saved_prompt(plain, tmp_path)
    second = on_cache_dir(plain, tmp_path)
    second.prefix.cost.prefill_s_per_token = 1e-12
    stuck, failed = Future(), Future()
    failed.set_exception(OSError("index unreadable (test)"))
    second.store.blocks_on_disk_ahead = lambda hashes: stuck
    second.prefix.disk_checks.append(failed)
    out = second.generate([PROMPT + [7, 8, 9]], PARAMS)[0]
    assert second.prefix.disk_checks == [stuck]  # kept for later; the failed one dropped
    stuck.set_result({h.hex() for h in out_hashes(second, PROMPT + [7, 8, 9])})
    second.prefix.persist([], second.fingerprint)
    assert second.prefix.disk_checks == []
    assert set(out_hashes(second, PROMPT + [7, 8, 9])) <= second.prefix.persisted
    second.close()
    assert (out.num_cached_tokens == 0
            and out.token_ids == no_cache_tokens(plain[1], [PROMPT + [7, 8, 9]])[0][:4])


def out_hashes(engine, prompt: list[int]) -> list[bytes]:
    return chain_hashes(
        engine.scheduler.root, prompt, engine.config.block_size, []
    )[: len(prompt) // 64]


def test_a_plan_prices_disk_reads_by_what_the_page_cache_holds(plain, tmp_path):
    """After a restart the plan asks the page cache how much of each blob it holds: with the
    blobs cached, loading is priced at the page cache's rate and chosen; with them evicted,
    at the disk's rate, and recomputing wins. The plan reports the fraction it saw."""
    _, engine = plain
    saved_prompt(plain, tmp_path)
    edited = PROMPT + [7, 8, 9]
    outs = {}
    for label in ("warm", "cold"):
        if label == "cold":
            evicted = evict_page_cache(tmp_path / "blobs")
        second = on_cache_dir(plain, tmp_path)
        cost = second.prefix.cost
        # page cache fast, disk slow: recomputing the prefix costs between the two loads
        cost.bandwidth.update({"page cache": 1e12, "disk": 1e3})
        cost.prefill_s_per_token = 1e-4
        observed = []
        cost.observe_load = partial(record, observed, cost.observe_load)
        outs[label] = second.generate([edited], PARAMS)[0]
        second.close()
        if label == "warm":  # the load (blocks and checkpoint, read together) reports what the
            # page cache held: its rate, not the disk's
            assert [(tier, resident) for tier, _, _, resident in observed] == [("disk", 1.0)]
    warm, cold = outs["warm"], outs["cold"]
    assert warm.cache_plan["disk_resident"] == 1.0 and warm.cache_plan["choice"] == "load"
    assert warm.num_cached_tokens == 192 and warm.reused_from == "disk"
    if not evicted:
        pytest.skip("this filesystem keeps files in memory (posix_fadvise cannot evict them)")
    assert cold.cache_plan["disk_resident"] == 0.0 and cold.cache_plan["choice"] == "recompute"
    assert warm.token_ids == cold.token_ids == no_cache_tokens(engine, [edited])[0][:4]


def evict_page_cache(folder) -> bool:
    """Drop the folder's files from the page cache; whether it worked."""
    from statechat.cache.blobs.residency import resident_fraction

    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    files = [f for f in folder.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return all(resident_fraction(f) == 0.0 for f in files)


def record(calls: list, learn, *args) -> None:
    calls.append(args)
    learn(*args)


def test_a_failed_restore_leaves_no_checkpoint_read_running(plain, tmp_path):
    """After a restart the checkpoint is read on a pool thread while the blocks are. When the
    blocks turn out unusable, the restore waits for that read before it gives up (a retry
    must not read the same blob twice at once), and the request recomputes correctly."""
    from statechat.cache.blobs import BlobError

    _, engine = plain
    saved_prompt(plain, tmp_path)
    second = on_cache_dir(plain, tmp_path)
    second.prefix.cost.prefill_s_per_token = 1.0  # loading always wins
    second.prefix.cost.observe_prefill = lambda *timed: None
    reads, running = [], []
    ahead, read = second.store.read_checkpoint_ahead, second.store.read_checkpoint
    second.store.read_checkpoint_ahead = lambda h: reads.append(ahead(h)) or reads[-1]
    second.store.read_checkpoint = lambda h: time.sleep(0.3) or read(h)  # a slow disk

    def unusable(hashes):
        running.append(sum(not f.done() for f in reads[:-1]))  # earlier attempts' reads
        raise BlobError("a segment is unusable (test)")

    second.store.load_blocks = unusable
    out = second.generate([PROMPT + [7, 8, 9]], PARAMS)[0]
    second.close()
    assert len(running) == 3 and running == [0, 0, 0]  # three attempts, never two reads at once
    assert out.num_cached_tokens == 0
    # (the plan says what happened: it said "load", the choice of its last attempt)
    assert out.cache_plan["choice"] == "recompute" and out.cache_plan["load_failed"]
    assert out.token_ids == no_cache_tokens(engine, [PROMPT + [7, 8, 9]])[0][:4]


def test_an_engine_starts_with_the_page_caches_rate_measured(plain, tmp_path, monkeypatch):
    """At start an engine times two reads of a stored checkpoint that the page cache holds
    (as a restore reads it) and prices page-cache reads at that rate; with no such checkpoint
    it keeps its guess."""
    from statechat.cache.store import lookup, reads
    from statechat.engine.prefix import PAGE_CACHE, CostModel

    guess = CostModel(1.0).bandwidth[PAGE_CACHE]
    empty = on_cache_dir(plain, tmp_path / "empty")
    empty.close()
    assert empty.prefix.cost.bandwidth[PAGE_CACHE] == guess
    saved_prompt(plain, tmp_path)
    monkeypatch.setattr(reads, "SAMPLE_MIN_BYTES", 1)  # the tiny model's checkpoints are small
    read_names, read_blob = [], reads.read_blob
    monkeypatch.setattr(reads, "read_blob",
                        lambda path, *a: read_names.append(path.name) or read_blob(path, *a))
    second = on_cache_dir(plain, tmp_path)
    second.close()
    rate = second.prefix.cost.bandwidth[PAGE_CACHE]
    last_boundary = out_hashes(second, PROMPT)[-1].hex()  # PROMPT's checkpoint, at 192
    assert len(read_names) == 2 and read_names[0] == read_names[1]
    assert read_names[0].startswith(last_boundary)
    assert rate != guess and rate > 0
    for module in (lookup, reads):  # not cached whole: no sample
        monkeypatch.setattr(module, "resident_fraction", lambda path: 0.5)
    read_names.clear()
    third = on_cache_dir(plain, tmp_path)
    third.close()
    assert read_names == [] and third.prefix.cost.bandwidth[PAGE_CACHE] == guess


def test_a_lookup_reads_a_small_index_ahead(plain, tmp_path, monkeypatch):
    """Every lookup asks the kernel to read the index (and its WAL) ahead, whole, unless it is
    larger than PREFETCH_INDEX_BYTES: a lookup in an index the page cache dropped would read
    its pages one at a time."""
    from statechat.cache.store import readahead

    saved_prompt(plain, tmp_path)
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append(
        (os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), advice)))
    opened = open_store(tmp_path)
    opened.where([], ["00" * 32])
    assert ("index.db", os.POSIX_FADV_WILLNEED) in advised
    advised.clear()
    monkeypatch.setattr(readahead, "PREFETCH_INDEX_BYTES", -1)  # (an empty WAL is over it too)
    opened.where([], ["00" * 32])
    assert advised == []


def test_a_checkpoint_whose_blob_failed_is_saved_again_once_recomputed(plain, tmp_path):
    """A checkpoint whose blob is gone is recomputed, and the recompute writes it back: the next
    process resumes there again (it used to stay unsaved, taken as still on disk)."""
    path, no_cache = plain
    loaded = no_cache.loaded
    prompt = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def run() -> int:
        engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path),
                           loaded=loaded)
        out = engine.generate([prompt], params)[0]
        engine.close()
        return out.num_cached_tokens

    assert run() == 0
    store = open_store(tmp_path)
    (blob,) = store.db.execute("SELECT blob FROM checkpoints WHERE num_tokens = 192").fetchone()
    store.close()
    (tmp_path / "blobs" / blob).unlink()
    assert run() < 192  # (the blob is missing: a warning, and the prompt is computed)
    assert run() == 192


def test_a_lookup_leaves_sqlites_locks_alone(tmp_path):
    """The index's read-ahead advises through SQLite's own descriptors. It opened and closed
    one of its own, which dropped this process's POSIX locks on index.db: another process
    closing its connection then took the WAL for unused and deleted it, and every row this one
    wrote after was lost to the others (chat turns, cache rows)."""
    store = open_store(tmp_path)
    store.where([], ["00" * 32])  # a lookup: the read-ahead
    db = tmp_path / "index.db"
    other = f"import sqlite3; c = sqlite3.connect({str(db)!r}); "
    read = "c.execute('SELECT count(*) FROM sqlite_master').fetchall(); c.close()"
    subprocess.run([sys.executable, "-c", other + read], check=True, timeout=60)
    assert (tmp_path / "index.db-wal").exists()
    with store.db_lock:
        store.db.execute("CREATE TABLE probe (x)")
        store.db.execute("INSERT INTO probe VALUES (1)")
    seen = subprocess.run([sys.executable, "-c", other + "print(c.execute('SELECT x FROM probe')"
                           ".fetchall())"], capture_output=True, text=True, timeout=60, check=False)
    assert seen.stdout.strip() == "[(1,)]", seen.stderr[-300:]
    store.close()


def test_a_stopped_reply_leaves_its_reply_end_checkpoint_on_disk(plain, tmp_path):
    """A reply stopped mid-way (Esc, a client gone, Ctrl+Q) publishes the checkpoint at its last
    block boundary, as a finished one does; it reached the disk only if another step ran after
    the stop (after Esc then Ctrl+Q, never), so the next turn recomputed the whole reply."""
    engine = on_cache_dir(plain, tmp_path)
    seq = engine.add_request(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    while len(seq.output_ids) < 130:  # (past the boundaries at 256 and 320)
        engine.step()
    engine.abort(seq)
    engine.close()
    db = open_store(tmp_path, read_only=True).db
    saved = {r["num_tokens"] for r in db.query("SELECT num_tokens FROM checkpoints")}
    assert 320 in saved, saved


def test_a_hugging_face_snapshot_is_named_by_its_repo_id(tiny_dirs, tmp_path):
    """The `models` row of a checkpoint in a Hugging Face cache names its repo, as `serve`
    does (it was the snapshot's commit hash, which `cache stats` and the views showed)."""
    import shutil
    import sqlite3

    snapshot = tmp_path / "hub" / "models--Qwen--Tiny" / "snapshots" / ("ab" * 20)
    shutil.copytree(tiny_dirs["qwen3_5_text"], snapshot)
    engine = LLMEngine(EngineConfig(model=snapshot, device="cpu", cache_dir=tmp_path / "cache"),
                       loaded=load_model(snapshot, dtype=torch.float32))
    engine.close()
    db = sqlite3.connect(tmp_path / "cache" / "index.db")
    assert db.execute("SELECT name, path FROM models").fetchall() == [("Qwen/Tiny",
                                                                       str(snapshot))]
    db.close()


def test_a_checkpoint_cleared_under_a_running_engine_is_saved_again_once_recomputed(plain,
                                                                                    tmp_path):
    """`statechat cache clear` while an engine runs: a checkpoint that engine had seen on disk
    (a restore from it) and computes again, once its device memory has let it go, is written
    back, so the next process resumes there (it was taken as still on disk and never saved)."""
    path, no_cache = plain
    gen = torch.Generator().manual_seed(9)
    prompt, *others = (torch.randint(0, 300, (200,), generator=gen).tolist() for _ in range(7))

    def engine() -> LLMEngine:  # (few state slots: other prompts evict the checkpoint)
        return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path,
                                      num_state_slots=8), loaded=no_cache.loaded)

    first = engine()
    first.generate([prompt], PARAMS)
    first.close()
    running = engine()
    assert running.generate([prompt], PARAMS)[0].num_cached_tokens == 192  # from disk
    cleared = open_store(tmp_path)
    cleared.clear()
    cleared.close()
    running.generate(others, PARAMS)  # (the device tier lets the checkpoint go)
    assert running.generate([prompt], PARAMS)[0].num_cached_tokens == 0
    running.close()
    after = engine()
    out = after.generate([prompt], PARAMS)[0]
    after.close()
    assert (out.num_cached_tokens, out.reused_from) == (192, "disk")


def test_a_load_the_device_has_no_room_for_is_reported_as_a_recompute(plain, tmp_path):
    """A plan that chose to load a prefix from disk, when the device has too few free blocks
    to load it into, computes the prompt instead: its plan says so (it said `load` with 0
    tokens reused, and the server logged a load that never ran)."""
    path, no_cache = plain
    saved_prompt(plain, tmp_path)  # (192 tokens of PROMPT on disk)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=tmp_path, num_kv_blocks=6,
                                    max_num_batched_tokens=128), loaded=no_cache.loaded)
    other = engine.add_request([7] * 100 + [9] * 100, SamplingParams(max_tokens=8,
                                                                     ignore_eos=True))
    while not other.is_decoding:  # (it holds 4 of the 6 blocks)
        engine.step()
    seq = engine.add_request(PROMPT, PARAMS)
    engine.step()  # (admitted: its load needs 3 blocks, its first chunk 1)
    out = engine.output(seq)
    engine.abort(seq)
    engine.close()
    assert out.num_cached_tokens == 0 and out.num_computed_tokens == 64
    assert out.cache_plan["choice"] == "recompute" and out.cache_plan["no_room"]
