"""End-to-end benchmark on a GPU: statechat vs transformers on one random-weight Qwen3.5 model.

    python3 scripts/bench_e2e.py [--layers 24] [--long 32768] [--out DIR]

The model has Qwen3.5's shapes at about 1B parameters (hidden 1024, 24 layers in the 3:1
pattern, 8 query and 2 KV heads of 256, 16 GDN heads of 128, vocab 248320, bf16). Both engines
run the same weights in the same process. Measured:
- decode at batch 1 after an 8k-token prompt (ms/token), ours vs transformers, and the floor
  (weight bytes over the device-to-device copy bandwidth measured here);
- decode throughput at batch 32 and 128 (tokens/s);
- cold prefill of 8k and 32k tokens (time to first token), ours vs transformers;
- time to first token after an edit of the last user message of an 8k conversation, served
  from the device-tier cache, as a fraction of the cold prefill.
A markdown table is printed last and written to DIR/bench_e2e.md.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from bench_common import (
    add_tokenizer,
    decode_rate,
    hf_decode_ms,
    hf_prefill,
    ids,
    log,
    row,
    sync,
    ttft,
    ttft_out,
    write_table,
)

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams


def build_model(out: Path, layers: int):
    """Random-weight Qwen3.5 saved with transformers (our loader reads it back)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=65536, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    hf.save_pretrained(out)
    add_tokenizer(out)
    return hf


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def graph_replay_ms(engine: LLMEngine, n: int = 200) -> float:
    """GPU time of one batch-1 decode step: the captured graph replayed back to back, on the
    inputs of the last step staged (an idle engine's). Each replay ends by advancing its rows
    to the next step's inputs; with every row marked as writing no KV, none moves: the replays
    all attend over the same keys and write into no block."""
    graphs = engine.runner.graphs
    graphs.slot_mapping.fill_(-1)
    graph = graphs.graphs[1]
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def profile_decode(engine: LLMEngine) -> None:
    """Where a batch-1 decode step's host time goes (top functions by own time)."""
    import cProfile
    import pstats

    seq = engine.add_request(ids(1024, 77), SamplingParams(max_tokens=80, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    while not seq.is_finished:
        engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    # GPU kernels of a decode step (eager, so the profiler sees each kernel)
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    seq = engine.add_request(ids(1024, 78), SamplingParams(max_tokens=24, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        while not seq.is_finished:
            engine.step()
    engine.runner.graphs = graphs
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def edit_breakdown(engine: LLMEngine, edited: list[int]) -> None:
    """Where an edit's time to first token goes on the host, from one request replayed from
    the graphs: admission (hashing, lookup, restore), launching the step, waiting for its
    tokens, and the step's bookkeeping after them."""
    marks: dict[str, float] = {}
    schedule, before_wait = engine.scheduler.schedule, engine.runner.before_wait
    collect = engine.runner.collect

    def timed_schedule():
        batch = schedule()
        marks.setdefault("scheduled", time.perf_counter())
        return batch

    def timed_wait():
        marks.setdefault("launched", time.perf_counter())
        before_wait()

    def timed_collect(launched):
        tokens = collect(launched)
        marks.setdefault("tokens", time.perf_counter())
        return tokens

    engine.scheduler.schedule = timed_schedule
    engine.runner.before_wait, engine.runner.collect = timed_wait, timed_collect
    sync()
    try:
        start = time.perf_counter()
        seq = engine.add_request(edited, SamplingParams(max_tokens=1, ignore_eos=True))
        added = time.perf_counter()
        while not seq.is_finished:
            engine.step()
        end = time.perf_counter()
    finally:
        engine.scheduler.schedule, engine.runner.before_wait = schedule, before_wait
        engine.runner.collect = collect
    steps = [("add_request", start, added), ("admission", added, marks["scheduled"]),
             ("launch", marks["scheduled"], marks["launched"]),
             ("wait for tokens", marks["launched"], marks["tokens"]),
             ("after the tokens", marks["tokens"], end)]
    parts = ", ".join(f"{name} {(b - a) * 1e3:.2f}" for name, a, b in steps)
    log(f"edit TTFT host breakdown (ms): {parts}; total {(end - start) * 1e3:.2f}")


def profile_edit_host(engine: LLMEngine, edited: list[int]) -> None:
    """Where an edit's host time goes (top functions by own time), graphs replayed."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    ttft_out(engine, edited)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def profile_edit(engine: LLMEngine, edited: list[int]) -> None:
    """GPU kernels of an edit's resumed prefill (eager, so the profiler sees each kernel)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.prefill_graphs = engine.runner.prefill_graphs, None
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        ttft_out(engine, edited)
    engine.runner.prefill_graphs = graphs
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from transformers.utils import import_utils

    log(torch.cuda.get_device_name(), "torch", torch.__version__,
        "fla available to transformers:",
        getattr(import_utils, "is_flash_linear_attention_available", lambda: "?")())
    path = Path("/tmp/statechat-e2e")
    hf = build_model(path, args.layers)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    bw = copy_bandwidth()
    floor_ms = weight_bytes / bw * 1e3
    log(f"params {weight_bytes / 2e9:.2f} B, copy bandwidth {bw / 1e9:.0f} GB/s, "
        f"floor {floor_ms:.3f} ms/token")

    cold = LLMEngine(EngineConfig(model=path, device="cuda", enable_prefix_cache=False,
                                  memory_fraction=0.4, max_model_len=args.long + 1024,
                                  max_num_seqs=128, max_num_batched_tokens=8192))
    ttft(cold, ids(8192, 1))  # compile every kernel at these shapes
    results = {}
    for n in (8192, args.long):
        ours = min(ttft(cold, ids(n, 2 + i)) for i in range(2))
        theirs, out = hf_prefill(hf, torch.tensor([ids(n, 99)], device="cuda"))
        results[n] = ours
        row(f"cold prefill {n // 1024}k (ms)", f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}",
            f"ratio {ours / theirs:.2f}")
        if n == 8192:
            hf_ms = hf_decode_ms(hf, out)
        del out
        torch.cuda.empty_cache()
    step_s, _ = decode_rate(cold, [ids(8192, 5)], 129)
    gpu_ms = graph_replay_ms(cold)
    row("decode batch 1 after 8k (ms/token)", f"{step_s * 1e3:.2f}", f"{hf_ms:.2f}",
        f"floor {floor_ms:.2f} ms; ours/floor {step_s * 1e3 / floor_ms:.2f}; "
        f"graph replay alone {gpu_ms:.2f} ms")
    profile_decode(cold)
    for batch in (32, 128):
        _, tps = decode_rate(cold, [ids(256, 100 + i) for i in range(batch)], 128)
        row(f"decode throughput batch {batch} (tokens/s)", f"{tps:,.0f}")
    del cold
    torch.cuda.empty_cache()

    warm = LLMEngine(EngineConfig(model=path, device="cuda", memory_fraction=0.4,
                                  max_model_len=args.long + 1024))
    times = []
    for seed in (10, 12, 8, 14, 16):  # the first conversation warms up (compiles) the resume path
        convo = ids(8192, seed)
        warm.generate([convo], SamplingParams(max_tokens=16, ignore_eos=True))
        edited = convo[:8192 - 40] + ids(60, seed + 1)
        t, out = ttft_out(warm, edited)
        times.append(t)
        log(f"edit TTFT {t * 1e3:.1f} ms, reused {out.num_cached_tokens}")
    t = sorted(times[1:])[len(times[1:]) // 2]  # median after the warm-up
    edit_breakdown(warm, convo[:8192 - 40] + ids(60, 98))
    profile_edit_host(warm, convo[:8192 - 40] + ids(60, 97))
    profile_edit(warm, convo[:8192 - 40] + ids(60, 99))
    graphs = warm.runner.prefill_graphs
    row("TTFT after editing the last message, 8k, device tier (ms)", f"{t * 1e3:.1f}", "",
        f"{t / results[8192] * 100:.1f}% of cold prefill (median of 4); "
        f"reused {out.num_cached_tokens} tokens; "
        f"prefill graph replays {graphs.replays if graphs else 0}")
    write_table(args.out, "bench_e2e")


if __name__ == "__main__":
    main()
