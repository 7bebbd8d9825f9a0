"""CPU benchmark of chunked-prefill fairness: how long a decoding stream stalls while a long
prompt arrives, and what the long prompt's prefill costs, alone and alongside.

    python scripts/bench_fairness.py [--hidden 64] [--layers 8] [--long 8192] [--threads 2]
        [--max-step-ms MS] [--budget 4096]

The model is a random-weight Qwen3.5 written with transformers (hidden 64 and 8 layers: the
tests' tiny model; hidden 512 is nearer what a user of a real model on a CPU feels), with the
embedded model's tokenizer. Measured, each after a warm-up run:
- the long prompt's prefill alone (from its arrival to its first token);
- a stream decoding while the long prompt arrives: its median and worst gap between tokens
  while the long prompt prefills, and the long prompt's prefill time alongside.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_tokenizer, ids, log

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams

VOCAB = 384  # the embedded tokenizer's


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A random-weight Qwen3.5 (3 GDN layers : 1 attention layer) of the given width."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    heads = max(hidden // 64, 2)
    head = hidden // heads
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
        head_dim=head, linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
        linear_key_head_dim=head, linear_value_head_dim=head, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(cfg).float().eval().save_pretrained(out)
    add_tokenizer(out)
    return out


def prefill_alone(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from the prompt's arrival to its first token, with nothing else running."""
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - t0


def alongside(engine: LLMEngine, prompt: list[int], seed: int) -> tuple[list[float], float]:
    """A stream decodes; after 8 of its tokens the long prompt arrives. Returns the stream's
    gaps between tokens while the long prompt prefills, and the long prompt's prefill time."""
    stream = engine.add_request(ids(32, seed, VOCAB),
                                SamplingParams(max_tokens=100_000, temperature=0.0,
                                               ignore_eos=True))
    while len(stream.output_ids) < 8:
        engine.step()
    t0 = last = time.perf_counter()
    long = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    gaps: list[float] = []
    while not long.is_finished:
        before = len(stream.output_ids)
        engine.step()
        if len(stream.output_ids) > before:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    took = time.perf_counter() - t0
    engine.abort(stream)
    return gaps, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--max-step-ms", type=float, default=None)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    extra = {} if args.max_step_ms is None else {"max_step_ms": args.max_step_ms}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.hidden, args.layers)
        engine = LLMEngine(EngineConfig(model=model, device="cpu", enable_prefix_cache=False,
                                        max_num_batched_tokens=args.budget, **extra))
        log(f"hidden {args.hidden}, {args.layers} layers, {args.threads} threads, budget "
            f"{args.budget}, {extra or 'default max_step_ms'}")
        prefill_alone(engine, ids(args.long, 99, VOCAB))  # (warm-up: the rate is learned)
        for run in range(args.runs):
            alone = prefill_alone(engine, ids(args.long, run, VOCAB))
            gaps, took = alongside(engine, ids(args.long, 100 + run, VOCAB), 200 + run)
            log(f"run {run}: prefill alone {alone:.2f} s; alongside {took:.2f} s; stream gaps "
                f"median {1e3 * statistics.median(gaps):.0f} ms, worst {1e3 * max(gaps):.0f} ms "
                f"({len(gaps)} tokens); rate {engine.prefix.cost.prefill_s_per_token * 1e6:.0f}"
                f" us/token")


if __name__ == "__main__":
    main()
