"""GPU benchmark of steps that mix sequences: decodes beside a new prompt's chunk, or chunks of
a few prompts at once. Such a step replays one packed graph for them all, or the decode graph
and one packed graph for the chunks ("packed", the engine's path since session 34); or the
decode graph and each chunk's prefill graph in turn ("parts", session 32's path, forced here by
hiding the packed graphs); or runs eagerly ("eager", the path before session 32). All three in
one process, in turn, on bench_e2e's random-weight model (hidden 1024, 24 layers, vocab
248320, bf16).

    python3 scripts/bench_mixed.py [--layers 24] [--runs 5] [--out DIR]

Measured, per path (median of --runs):
- a prompt of P tokens arriving while N streams decode (256-token prompts): the step that
  mixes them (each stream's gap between two tokens), and the prompt's time to first token;
- 2 to 8 prompts (100 and 300 tokens) arriving together at an idle engine: time to every
  first token (in parts whatever their count);
- an 8k prompt arriving while 8 streams decode: the streams' longest gap, and the prompt's
  time to first token (its chunks of the 4096-token budget share steps with the decodes).
A markdown table is printed last and written to DIR/bench_mixed.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_common import ids, log, row, sync, write_table
from bench_e2e import build_model

from statechat.config import EngineConfig
from statechat.engine import replay
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams

STREAM = SamplingParams(max_tokens=100_000, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, ignore_eos=True)
TOGETHER = (2, 4, 6, 8)  # prompts arriving at once


MODES = ("packed", "parts", "eager")


def set_mode(engine: LLMEngine, mode: str, limit: int = replay.MAX_SPLIT_CHUNKS) -> None:
    """Make mixed steps take the path `mode` (MODES; "parts": for steps of up to `limit`
    chunks)."""
    runner = engine.runner
    graphs = runner.prefill_graphs
    graphs.__dict__.setdefault("all_packed", graphs.packed)
    graphs.packed = graphs.all_packed if mode == "packed" else []
    replay.MAX_SPLIT_CHUNKS = limit
    if mode == "eager":
        runner._split_buckets = lambda batch: None
    else:
        runner.__dict__.pop("_split_buckets", None)


def start_streams(engine: LLMEngine, n: int, seed: int) -> list:
    seqs = [engine.add_request(ids(256, seed + i), STREAM) for i in range(n)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    return seqs


def stop(engine: LLMEngine, seqs: list) -> None:
    for s in seqs:
        engine.abort(s)
    while engine.has_unfinished():
        engine.step()


def arrival(engine: LLMEngine, streams: int, prompt: int, seed: int) -> tuple[float, float]:
    """(longest step while the prompt prefills, the prompt's time to first token), seconds."""
    seqs = start_streams(engine, streams, seed) if streams else []
    sync()
    new = engine.add_request(ids(prompt, seed + 999), FIRST)
    t0, worst = time.perf_counter(), 0.0
    while not new.is_finished:
        t = time.perf_counter()
        engine.step()
        worst = max(worst, time.perf_counter() - t)
    ttft = time.perf_counter() - t0
    stop(engine, seqs)
    return worst, ttft


def together(engine: LLMEngine, k: int, seed: int) -> float:
    """Seconds until each of k prompts (100 and 300 tokens in turn) arriving at once at an idle
    engine has its first token."""
    sync()
    t0 = time.perf_counter()
    seqs = [engine.add_request(ids(100 + 200 * (i % 2), seed + i), FIRST) for i in range(k)]
    while not all(s.is_finished for s in seqs):
        engine.step()
    return time.perf_counter() - t0


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    log(torch.cuda.get_device_name(), "torch", torch.__version__)
    path = Path("/tmp/statechat-e2e")
    if not (path / "config.json").exists():
        build_model(path, args.layers)  # (transformers' copy is not needed here)
        torch.cuda.empty_cache()
    engine = LLMEngine(EngineConfig(model=path, device="cuda", enable_prefix_cache=False,
                                    memory_fraction=0.5, max_model_len=16384, max_num_seqs=64))
    for mode in MODES:  # warm-up: every path once (the packed graphs' captures)
        set_mode(engine, mode)
        for streams, prompt in ((1, 100), (8, 100), (32, 100), (8, 1000), (8, 8192)):
            arrival(engine, streams, prompt, 1)
        for k in TOGETHER:
            together(engine, k, 2)
    cases = [(1, 100), (8, 100), (32, 100), (8, 1000)]
    results: dict = {}
    for run in range(args.runs):
        for mode in MODES:
            set_mode(engine, mode)
            for streams, prompt in cases:
                worst, first = arrival(engine, streams, prompt, 10 * run)
                results.setdefault(("gap", streams, prompt, mode), []).append(worst)
                results.setdefault(("ttft", streams, prompt, mode), []).append(first)
            for k in TOGETHER:  # (in parts whatever the count)
                set_mode(engine, mode, limit=max(TOGETHER))
                results.setdefault(("together", k, mode), []).append(together(engine, k, run))
                set_mode(engine, mode)
            if run < 2:  # (the long prompt: fewer runs)
                worst, first = arrival(engine, 8, 8192, 10 * run)
                results.setdefault(("gap", 8, 8192, mode), []).append(worst)
                results.setdefault(("ttft", 8, 8192, mode), []).append(first)
    log("split steps:", engine.runner.split_steps)
    for streams, prompt in cases + [(8, 8192)]:
        parts = {mode: " / ".join(median_ms(results[(k, streams, prompt, mode)])
                                  for k in ("gap", "ttft")) for mode in MODES}
        row(f"{prompt}-token prompt beside {streams} streams: longest step / TTFT (ms)",
            parts["packed"], "", f"parts: {parts['parts']}; eager: {parts['eager']}")
    for k in TOGETHER:
        ms = {mode: median_ms(results[("together", k, mode)]) for mode in MODES}
        row(f"{k} prompts (100, 300 tokens in turn) at once: every first token (ms)",
            ms["packed"], "", f"parts: {ms['parts']}; eager: {ms['eager']}")
    write_table(args.out, "bench_mixed")


if __name__ == "__main__":
    main()
