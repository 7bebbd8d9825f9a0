"""What sampling options cost a decode step on a GPU, on bench_e2e's random-weight model.

    python3 scripts/bench_sampling.py [--layers 24] [--out DIR]

Decode after an 8k-token prompt at batch 1, and from 256-token prompts at batch 32, each
request with the same options: greedy (the graph's own argmax), temperature alone, with
top-p (and that through torch's sort, the sampler's path before kernels.sample_vocabulary),
with min-p and top-k, greedy under presence + frequency + repetition penalties, and greedy with
logprobs of the 5 likeliest tokens, and the sampling Qwen's model cards recommend (with the
sampler's CUDA graphs, without them, and seeded, which samples eagerly), and greedy under a
logit bias (eager: the logits are copied and biased). ms per step, and each
against greedy's, in one run. Then the draw alone over Qwen3.5's vocabulary (random logits,
`triton.testing.do_bench`), sample_vocabulary against torch's sort, and the logprob table
(kernels.score_logits) against torch's ops, at 1 and 32 rows. A
markdown table is printed last and written to DIR/bench_sampling.md.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from bench_common import decode_rate, ids, log, model_args, row, write_table
from bench_e2e import build_model

import kernels
from statechat.config import EngineConfig
from statechat.engine import sampler
from statechat.engine.engine import LLMEngine
from statechat.engine.sampler_graphs import SamplerGraphs
from statechat.engine.sampling import SamplingParams

QWEN = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "presence_penalty": 1.5}
CASES = {  # (no seed, as `statechat run` draws: a seeded step samples eagerly)
    "greedy": {},
    "temperature 1.0": {"temperature": 1.0},
    "temperature 0.7, top-p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "temperature 0.7, top-p 0.95, torch's sort": {"temperature": 0.7, "top_p": 0.95, "sort": True},
    "and min-p 0.05, top-k 20": {"temperature": 0.7, "top_p": 0.95, "min_p": 0.05, "top_k": 20},
    "temperature 0.7, top-k 100, top-p 0.95 (top-k past the fused 64)": {
        "temperature": 0.7, "top_p": 0.95, "top_k": 100},
    "greedy, penalties (presence, frequency, repetition)": {
        "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "greedy, logprobs 5": {"logprobs": 5},
    "Qwen's recommended: temperature 0.6, top-k 20, top-p 0.95, presence 1.5": QWEN,
    "Qwen's recommended, sampler graphs off": {**QWEN, "graphs": False},
    "Qwen's recommended, seeded (eager)": {**QWEN, "seed": 0},
    "greedy, logit_bias of 3 tokens (eager)": {"logit_bias": {7: 2.0, 11: -1.0, 13: 0.5}},
}


def main() -> None:
    args = model_args()
    path = Path("/tmp/statechat-sampling")
    build_model(path, args.layers)  # (the transformers model it returns is dropped)
    torch.cuda.empty_cache()
    engine = LLMEngine(EngineConfig(model=path, device="cuda", enable_prefix_cache=False,
                                    memory_fraction=0.5, max_model_len=9216, max_num_seqs=64))
    decode_rate(engine, [ids(8192, 1)], 16)  # compile every kernel at these shapes
    base = {}
    graphs, retired = engine.runner.sampler_graphs, []
    for name, sampling in CASES.items():
        sampling = dict(sampling)
        graphs.is_enabled = sampling.pop("graphs", True)
        fused = 0 if sampling.pop("sort", False) else 2**19
        if fused != sampler.FUSED_VOCAB:  # (fresh graphs: one captured on the other path
            sampler.FUSED_VOCAB = fused  # would replay; the old ones are kept, not freed)
            retired.append(graphs)
            graphs = engine.runner.sampler_graphs = SamplerGraphs(graphs.device)
        b1, _ = decode_rate(engine, [ids(8192, 2)], 129, **sampling)
        b32, _ = decode_rate(engine, [ids(256, 100 + i) for i in range(32)], 128, **sampling)
        base = base or {"b1": b1, "b32": b32}
        log(name, "sampler graphs: captures", graphs.captures, "replays", graphs.replays)
        row(name, f"{b1 * 1e3:.2f} / {b32 * 1e3:.2f}", "",
            f"x greedy {b1 / base['b1']:.2f} / {b32 / base['b32']:.2f}")
    sampler.FUSED_VOCAB = 2**19
    draw_alone()
    write_table(args.out, "bench_sampling")


def draw_alone(vocab: int = 248320) -> None:
    """us per draw over random bf16 logits, the fused kernels against torch's sort, at 1 and 32
    rows: temperature 0.7 with top-p 0.95 over logits of std 3 (some tokens stand out), and
    top-p 0.05 over nearly flat ones (std 0.1: most rows need the exact search, on the edge of
    the top-p set among hundreds of equal logits)."""
    from triton.testing import do_bench

    for std, top_p, n in [(3.0, 0.95, 1), (3.0, 0.95, 32), (0.1, 0.05, 1), (0.1, 0.05, 32)]:
        params = SamplingParams(temperature=0.7, top_p=top_p)
        logits = (torch.randn(n, vocab, device="cuda") * std).bfloat16().float()  # (a model's:
        # bf16, so many are equal)
        plan = sampler.Plan.of([params] * n, None, [None] * n)
        rows = sampler.Rows.of(*plan.values(), plan.params, logits.device)
        times = {}
        for fused in (True, False):
            sampler.FUSED_VOCAB = 2**19 if fused else 0
            pick = functools.partial(plan.pick, logits, rows, [None] * n, None, None)
            times[fused] = do_bench(pick, warmup=25, rep=200) * 1e3
        row(f"the draw alone, top-p {top_p}, logits of std {std}, {n} row(s): "
            "sample_vocabulary / torch's sort (us)",
            f"{times[True]:.1f} / {times[False]:.1f}", "", f"{times[True] / times[False]:.2f}x")
    sampler.FUSED_VOCAB = 2**19
    for n in (1, 32):  # the logprob table of 5 (logprobs: 5), by the kernel and by torch's ops
        logits = torch.randn(n, vocab, device="cuda") * 3
        tokens = torch.randint(0, vocab, (n,), device="cuda")
        ours, torchs = (do_bench(functools.partial(fn, logits, tokens, 5), warmup=25, rep=200) * 1e3
                        for fn in (kernels.score_logits, kernels.reference.score_logits))
        row(f"the logprob table alone (k = 5), {n} row(s): score_logits / torch's ops (us)",
            f"{ours:.1f} / {torchs:.1f}", "", f"{ours / torchs:.2f}x")


if __name__ == "__main__":
    main()
