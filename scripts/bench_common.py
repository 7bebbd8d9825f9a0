"""Helpers shared by the end-to-end benchmarks (bench_e2e, bench_moe, bench_cache).

Timing of engine requests (time to first token, decode steps), transformers' prefill and decode
on the same weights, random prompts, checkpoint directories written by transformers, and the
result table printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL

ROWS: list[tuple[str, str, str, str]] = []


def log(*a) -> None:
    print(*a, flush=True)


def row(what: str, ours: str, theirs: str = "", note: str = "") -> None:
    """Record one result row (and print it at once)."""
    ROWS.append((what, ours, theirs, note))
    log(f"| {what} | {ours} | {theirs} | {note} |")


def write_table(out_dir: str, name: str) -> None:
    """Write the rows to OUT/name.json and OUT/name.md and print the table last."""
    Path(out_dir, f"{name}.json").write_text(json.dumps(ROWS, indent=1))
    table = ["| measure | statechat | transformers | note |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in ROWS]
    Path(out_dir, f"{name}.md").write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table))


def model_args() -> argparse.Namespace:
    """--layers (24) and --out (DIR, else $OUT, else .) of the benchmarks on bench_e2e's model;
    the device is logged."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    log(torch.cuda.get_device_name(), "torch", torch.__version__)
    return args


def add_tokenizer(out: Path) -> None:
    """Our loader needs tokenizer files beside the weights: take the embedded model's."""
    for f in EMBEDDED_MODEL.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)


def ids(n: int, seed: int, vocab: int = 248000) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft_out(engine, prompt: list[int]):
    """(seconds to the first token, RequestOutput) of one request on an idle engine."""
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    sync()
    t = time.perf_counter()
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - t, engine.output(seq)


def ttft(engine, prompt: list[int]) -> float:
    return ttft_out(engine, prompt)[0]


def decode_rate(engine, prompts: list[list[int]], new: int, **sampling) -> tuple[float, float]:
    """(seconds per decode step, generated tokens per second) once every prompt has started;
    `sampling`: SamplingParams fields beyond greedy's."""
    params = SamplingParams(max_tokens=new, ignore_eos=True, **sampling)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(len(s.output_ids) == 0 for s in seqs):
        engine.step()
    steps, before = 0, sum(len(s.output_ids) for s in seqs)
    sync()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t
    made = sum(len(s.output_ids) for s in seqs) - before
    return dt / steps, made / dt


@torch.inference_mode()
def hf_prefill(hf, x: torch.Tensor) -> tuple[float, object]:
    """transformers' prefill of x [B, T] (after one warm-up at this shape): (seconds, output)."""
    hf(input_ids=x, use_cache=True, logits_to_keep=1)  # FLA autotunes per shape
    sync()
    t = time.perf_counter()
    out = hf(input_ids=x, use_cache=True, logits_to_keep=1)
    sync()
    return time.perf_counter() - t, out


@torch.inference_mode()
def hf_decode_ms(hf, out, steps: int = 32) -> float:
    """ms per greedy decode step of transformers continuing `out` (a prefill's output)."""
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        o = hf(input_ids=tok, past_key_values=past, use_cache=True)
        past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        o = hf(input_ids=tok, past_key_values=past, use_cache=True)
        past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
        tok.tolist()  # a server reads each token, as ours does
    return (time.perf_counter() - t) / steps * 1e3
