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
from functools import partial

import pytest
import torch

from statechat.cache.hashing import chain_hashes
from statechat.chat.template import render
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.engine.sequence import Sequence
from statechat.model.loader import load_model
from tests.helpers import ROOT, PolicyModel, subprocess_env

MAX_TOKENS = 16
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta", "gate", "kernel", "disk"]


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
    return path, LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False), loaded=loaded)


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
                prompts.append(render(tok, tree[:end], add_generation_prompt=tree[end - 1]["role"] == "user"))
        results = run_worker(path, tmp_path, prompts)
        want = no_cache_tokens(engine, prompts)
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
    return LLMEngine(EngineConfig(model=path, device="cpu", cache_dir=cache_dir), loaded=engine.loaded)


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
    first = saved_prompt(plain, tmp_path)
    assert first.store.stats()["num_checkpoints"] >= 1
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

    saved_prompt(plain, tmp_path)
    second = on_cache_dir(plain, tmp_path)
    second.prefix.cost.prefill_s_per_token = 1e-12
    asked, present = [], index.blocks_present
    monkeypatch.setattr(index, "blocks_present", lambda db, hashes: asked.append(
        threading.current_thread() is threading.main_thread()) or present(db, hashes))
    monkeypatch.setattr(second.store, "save", lambda job: pytest.fail("queued a stored prefix"))
    out = second.generate([PROMPT + [7, 8, 9]], PARAMS)[0]
    second.close()
    assert out.cache_plan["choice"] == "recompute" and out.cache_plan["load_is_lower_bound"]
    assert out.cache_plan["candidate_tokens"] == 192 and "disk_resident" not in out.cache_plan
    assert asked == [False]  # once, off the engine's thread


@pytest.mark.parametrize("rate", [1e-12, 1e-7, 1e-6, 1e-5, 1e-4, 1e-2])
def test_the_plan_bound_never_exceeds_the_plan(plain, tmp_path, rate):
    """The first plan's cost (every unknown block on disk at the best rate) is a lower bound of
    the plan made with the disk's blocks looked up, whatever the rates."""
    saved_prompt(plain, tmp_path)
    second = on_cache_dir(plain, tmp_path)
    pc = second.prefix
    pc.cost.prefill_s_per_token = rate
    pc.cost.bandwidth.update({"page cache": 2e9, "disk": 5e8})
    pc.cost.latency["disk"] = 0.0  # (the bound leaves latencies out: here they would hide it)
    seq = Sequence(PROMPT + [7, 8, 9], PARAMS)
    seq.block_hashes = chain_hashes(second.scheduler.root, seq.token_ids, second.config.block_size, [])
    hashes = seq.block_hashes[: (len(seq) - 1) // second.config.block_size]
    hx = [h.hex() for h in hashes]
    second.close()
    bound = pc._cheapest(len(seq), hashes, hx, 0, second.store.where(hx, hx, disk_blocks=False), optimistic=True)
    plan = pc._cheapest(len(seq), hashes, hx, 0, second.store.where(hx, hx))
    assert plan[0] == 3 and bound[0] == 3  # the checkpoint at 192
    assert bound[1] <= plan[1] and bound[2] <= plan[2]
    assert bound[2] >= plan[2] * (1 - 1e-9) or evicted_any(tmp_path)  # tight while cached


def evicted_any(cache_dir) -> bool:
    from statechat.cache.blobs import resident_fraction

    return any(resident_fraction(f) < 1.0 for f in (cache_dir / "blobs").rglob("*.safetensors"))


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
    from statechat.cache.blobs import resident_fraction

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
    second.prefix.cost.observe_prefill = lambda tokens, seconds: None
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
    assert out.token_ids == no_cache_tokens(engine, [PROMPT + [7, 8, 9]])[0][:4]
