"""What Triton compiles, and when: an engine's start, then serving, on an empty Triton cache.

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/bench_compiles.py [--layers 24] [--out DIR]
        [--no-graphs] [--moe]

Builds the random-weight model of bench_e2e (Qwen3.5's shapes at about 1B parameters, bf16),
or with --moe bench_moe's (Qwen3.5-35B-A3B's layer shapes, 8 layers unless --layers), starts
an engine (graphs captured, warm-up run) and serves, in turn: 32 requests of 256-token prompts
mixing greedy, penalties, Qwen's recommended sampling, top-p, logprobs and a top-k of 40;
three and then five prompts of other lengths; one long prompt; one short one. Triton's compile
hooks record every kernel build (a disk-cache hit on an empty cache is none), so the table
printed last says how many builds each phase made, how long they took, and the slowest step of
each serving phase (a build stalls its step, and every request in it). DIR/compiles.json
holds each build's kernel, phase, seconds and specialisation key.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import time
from pathlib import Path

import torch
import triton
from bench_common import ids, log
from bench_e2e import build_model
from bench_moe import build_model as build_moe_model
from triton import knobs

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams


class Builds:
    """Triton's builds as they happen (its jit cache hook runs before a compile, the post-compile
    hook after), each tagged with the phase it happened in."""

    def __init__(self) -> None:
        self.phase = "start"
        self.events: list[dict] = []
        self._began: dict[str, float] = {}
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **hook) -> bool:
        self._began[self._name(hook)] = time.perf_counter()
        return False  # (compile as usual)

    def _after(self, **hook) -> bool:
        began = self._began.pop(self._name(hook), time.perf_counter())
        self.events.append({"phase": self.phase, "kernel": hook["repr"].split("[", 1)[0],
                            "s": time.perf_counter() - began, "key": str(hook["key"])})
        return False

    @staticmethod
    def _name(hook: dict) -> str:
        """A build's kernel and specialisation key (two kernels may share a key)."""
        return hook["repr"].split("[", 1)[0] + str(hook["key"])

    def of(self, phase: str) -> list[dict]:
        return [e for e in self.events if e["phase"] == phase]

    def report(self, phase: str) -> None:
        per_kernel = collections.defaultdict(lambda: [0, 0.0])
        for e in self.of(phase):
            per_kernel[e["kernel"]][0] += 1
            per_kernel[e["kernel"]][1] += e["s"]
        for kernel, (n, s) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
            log(f"  {phase}: {kernel} {n} builds, {s:.2f} s")


def serve(engine: LLMEngine, builds: Builds, phase: str, prompts, params) -> float:
    """Serve the requests to the end; the slowest step's seconds (its builds are logged)."""
    builds.phase = phase
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    slowest, made = 0.0, []
    while engine.has_unfinished():
        before, t = len(builds.events), time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if dt > slowest:
            slowest, made = dt, [e["kernel"] for e in builds.events[before:]]
    log(f"{phase}: slowest step {slowest * 1e3:.1f} ms, building {made or 'nothing'}")
    return slowest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 24, or "
                    "8 with --moe)")
    ap.add_argument("--moe", action="store_true", help="bench_moe's Qwen3.5-MoE model instead")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-graphs", action="store_true",
                    help="steps eager, as on an NPU by default (the warm-up then runs a step of "
                    "the most tokens itself)")
    args = ap.parse_args()
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache or (Path(cache).exists() and any(Path(cache).iterdir())):
        raise SystemExit("set TRITON_CACHE_DIR to an empty directory: Triton's hooks count a "
                         "kernel loaded from its disk cache as a build")
    log(torch.cuda.get_device_name(), "triton", triton.__version__, "cache", cache)
    path = Path("/tmp/statechat-compiles" + ("-moe" if args.moe else ""))
    if args.moe:  # (the checkpoints they write are all we need of them)
        build_moe_model(path, args.layers or 8, per_expert=False)
    else:
        build_model(path, args.layers or 24)
    gc.collect()
    torch.cuda.empty_cache()  # (before the engine sizes its caches from the free memory)
    builds = Builds()
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=path, device="cuda", memory_fraction=0.4,
                                    use_graphs=False if args.no_graphs else None))
    started = time.perf_counter() - t
    kinds = [
        SamplingParams(max_tokens=40),
        SamplingParams(presence_penalty=1.0, max_tokens=40),
        SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, max_tokens=40),
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40),
        SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5, max_tokens=40),
        SamplingParams(max_tokens=40, logprobs=5),
        SamplingParams(temperature=0.8, top_k=40, max_tokens=40),
    ]
    mixed = [kinds[i % len(kinds)] for i in range(32)]
    phases = {  # (random prompts of distinct seeds: no prefix of one is another's)
        "32 mixed requests": ([256] * 32, mixed),
        "3 other lengths": ([77, 1000, 2100], mixed[:3]),
        "5 other lengths": ([33, 130, 515, 4000, 64], mixed[3:8]),
        "one long prompt": ([5000], kinds[2:3]),
        "one short prompt": ([317], kinds[:1]),
    }
    slowest, seed = {}, 1000
    for phase, (lengths, params) in phases.items():
        prompts = [ids(n, seed + i) for i, n in enumerate(lengths)]
        seed += len(lengths)
        slowest[phase] = serve(engine, builds, phase, prompts, params)
    for phase in ["start", *slowest]:
        builds.report(phase)
    with open(os.path.join(args.out, "compiles.json"), "w") as f:
        json.dump(builds.events, f, indent=1)
    print("\n| phase | builds | their compile time (s) | slowest step |")
    print("|---|---|---|---|")
    for phase, last in [("start", f"(engine start: {started:.1f} s)"),
                        *((p, f"{s * 1e3:.1f} ms") for p, s in slowest.items())]:
        made = builds.of(phase)
        print(f"| {phase} | {len(made)} | {sum(e['s'] for e in made):.1f} | {last} |")


if __name__ == "__main__":
    main()
