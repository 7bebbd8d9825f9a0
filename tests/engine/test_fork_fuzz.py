"""Forked conversations arriving together, seeded: the prefix cache changes nothing but the work.

Each round submits several requests at staggered steps, built from the conversations so far:
a new conversation, the next turn of one, an earlier user message edited, the last reply
regenerated, a reply continued. Requests of one round often share a prefix that another of
them is still computing. Requests are greedy or sampled with a seed, some end at a stop
string, and some are aborted mid-reply (their reply-end checkpoints are kept for later rounds).
With the prefix cache on, every request's tokens and text equal those of an engine with it off,
under token budgets that chunk prompts, block counts that preempt and evict, and several
checkpoint intervals. The CPU runs five of the configurations; a GPU
(Triton kernels, CUDA graphs, asynchronous steps) runs them all, with more seeds. A tiny MoE
model runs two of them on both.
"""

from __future__ import annotations

import random

import pytest
import torch

from statechat.chat.template import render
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import BLOCK, make_tiny

WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel", "slot", "graph", "chunk", "reply"]
ON_GPU = torch.cuda.is_available()
# (name, engine overrides; "disk": a disk tier, and the engine restarted half-way, so that
# later rounds resume from disk alone); the CPU runs the first five
CONFIGS = [
    ("small budget, interval 1", {"max_num_batched_tokens": 128, "checkpoint_interval": 1}),
    ("defaults", {}),
    ("few blocks: preempts and evicts", {"num_kv_blocks": 14, "checkpoint_interval": 2}),
    # (6 slots for 3-4 requests' working states and checkpoints: with 5, which checkpoint
    # survives to be reused is luck that a change in chunk order can turn to none in a seed)
    ("few state slots", {"max_num_batched_tokens": 192, "num_state_slots": 8,
                         "checkpoint_interval": 3}),
    ("disk tier, restarted", {"disk": True, "max_num_batched_tokens": 256,
                              "checkpoint_interval": 2}),
    ("no graphs, synchronous", {"use_graphs": False, "async_scheduling": False,
                                "max_num_batched_tokens": 64}),
]
CASES = [("dense", name, overrides, seed)
         for name, overrides in (CONFIGS if ON_GPU else CONFIGS[:5])
         for seed in ((1, 2, 3) if ON_GPU else (1, 2))]
# the MoE model (its routed experts' kernels on a GPU) under a chunking budget and few blocks
CASES += [("moe", name, overrides, 1) for name, overrides in (CONFIGS[0], CONFIGS[2])]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Workload:
    """Conversations (message lists) and the prompts forked from them."""

    def __init__(self, rng: random.Random, tokenizer) -> None:
        self.rng, self.tok = rng, tokenizer
        self.convos: list[list[dict]] = []

    def prompt(self) -> tuple[list[int], list[dict] | None]:
        """One request's token ids and the conversation its reply extends (None: a reply that
        is not kept as a turn)."""
        rng, convos = self.rng, self.convos
        kind = rng.choice(["new", "next", "next", "edit", "regenerate", "continue"])
        if kind == "new" or not convos:
            messages = [{"role": "system", "content": words(rng, rng.randint(5, 40))},
                        {"role": "user", "content": words(rng, rng.randint(5, 60))}]
            return render(self.tok, messages), messages
        convo = rng.choice(convos)
        if kind == "next":
            messages = convo + [{"role": "user", "content": words(rng, rng.randint(3, 50))}]
            return render(self.tok, messages), messages
        turns = [i for i, m in enumerate(convo) if m["role"] == "user"]
        if kind == "edit":
            at = rng.choice(turns)
            messages = convo[:at] + [{"role": "user", "content": words(rng, rng.randint(3, 50))}]
            return render(self.tok, messages), messages
        ends = [i for i, m in enumerate(convo) if m["role"] == "assistant"]
        if kind == "regenerate" and ends:
            return render(self.tok, convo[:rng.choice(ends)]), None
        if ends:  # continue a reply
            return render(self.tok, convo[:rng.choice(ends) + 1], add_generation_prompt=False), None
        return render(self.tok, convo), None

    def keep(self, messages: list[dict] | None, reply: str) -> None:
        if messages is not None:
            self.convos.append(messages + [{"role": "assistant", "content": reply}])


def request_params(max_tokens: int, rng: random.Random) -> tuple[SamplingParams, int | None]:
    """One request's sampling parameters, greedy or seeded, a stop string on some, and the
    number of reply tokens after which it is aborted (None: never)."""
    kw = {"max_tokens": max_tokens, "ignore_eos": True}
    if rng.random() < 0.4:
        kw.update(temperature=1.0, top_p=rng.choice([1.0, 0.9]), seed=rng.randint(0, 1 << 30))
    if rng.random() < 0.3:
        kw["stop"] = [rng.choice("aeinorst")]
    abort = rng.randint(1, kw["max_tokens"]) if rng.random() < 0.25 else None
    return SamplingParams(**kw), abort


def run_round(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
              aborts: list[int | None]):
    """Submit the prompts one or two at a time every other step; step until all finish. A
    request with an abort count is aborted once it has that many reply tokens (a step gives
    it one at most, so both engines abort it at the same token)."""
    pending, seqs, step = list(zip(prompts, params, aborts)), [], 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            for _ in range(min(len(pending), 1 + step % 4 // 2)):
                ids, p, abort = pending.pop(0)
                seqs.append((engine.add_request(ids, p), abort))
        engine.step()
        step += 1
        for seq, abort in seqs:
            if abort is not None and not seq.is_finished and len(seq.output_ids) >= abort:
                engine.abort(seq)
    return [engine.output(s) for s, _ in seqs]


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory):
    """kind -> (path, loaded model, device), each loaded once when first asked for."""
    device, made = ("cuda" if ON_GPU else "cpu"), {}

    def get(kind: str):
        if kind not in made:
            path = tiny_dirs["qwen3_5_text"] if kind == "dense" else make_tiny(
                tmp_path_factory.mktemp("moe") / "text", layout="qwen3_5_text",
                dtype="float32", moe=True, seed=3)
            made[kind] = path, load_model(path, dtype=torch.float32, device=device), device
        return made[kind]
    return get


@pytest.mark.parametrize("kind, name, overrides, seed", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_forked_conversations_arriving_together_match_no_cache(models, kind, name, overrides,
                                                              seed, tmp_path):
    path, loaded, device = models(kind)
    overrides = dict(overrides)
    disk = {"cache_dir": tmp_path} if overrides.pop("disk", False) else {}
    base = {"model": path, "device": device, "dtype": "float32", **overrides}
    cached = LLMEngine(EngineConfig(**base, **disk), loaded=loaded)
    plain = LLMEngine(EngineConfig(**base, enable_prefix_cache=False), loaded=loaded)
    rng, draw = random.Random(seed), random.Random(-seed)  # (the workload's, the params')
    work = Workload(rng, cached.tokenizer)
    reused, rounds = 0, 5 if ON_GPU else 3
    for _round in range(rounds):
        if disk and _round == rounds // 2:  # a new process's engine: the disk tier alone
            cached.close()
            cached = LLMEngine(EngineConfig(**base, **disk), loaded=loaded)
        made = [work.prompt() for _ in range(rng.randint(3, 6 if ON_GPU else 4))]
        prompts = [ids for ids, _ in made]
        params, aborts = zip(*(request_params(rng.randint(1, 24), draw) for _ in made))
        got = run_round(cached, prompts, params, aborts)
        want = run_round(plain, prompts, params, aborts)
        for i, (g, w, ids) in enumerate(zip(got, want, prompts)):
            where = f"round {_round} request {i} ({len(ids)} tokens, {params[i]})"
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text,
                                                              w.finish_reason), where
            assert g.num_cached_tokens % BLOCK == 0 and g.num_cached_tokens < len(ids)
            assert w.num_cached_tokens == 0
            reused += g.num_cached_tokens
        for (_, messages), out in zip(made, got):
            work.keep(messages, out.text)
    assert reused > 0, "no request reused a prefix: the workload tests nothing"
