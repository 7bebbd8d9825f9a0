"""A separate process that runs prompts through an engine with a disk cache (for restart,
crash and concurrency tests).

    python -m tests.cache.worker MODEL CACHE_DIR < requests.json > results.json

requests.json: {"prompts": [[ids...], ...], "max_tokens": N, "kill_trials": 0}
Prints one JSON line per finished request: {"i", "tokens", "cached", "reused_from", "plan"}.
With "kill_trials": n it loads the model once, then n times forks a child that generates (and
so writes checkpoints) in a loop, and kills it with SIGKILL at a random moment.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch


def main() -> None:
    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine
    from statechat.engine.sampling import SamplingParams
    from statechat.model.loader import load_model

    model, cache_dir = sys.argv[1], sys.argv[2]
    req = json.loads(sys.stdin.read())
    loaded = load_model(model, dtype=torch.float32)
    params = SamplingParams(max_tokens=req.get("max_tokens", 16), ignore_eos=True)

    def make_engine() -> LLMEngine:
        config = EngineConfig(model=model, device="cpu", dtype="float32", cache_dir=cache_dir,
                              checkpoint_interval=req.get("interval", 2), num_kv_blocks=256,
                              num_state_slots=96)
        return LLMEngine(config, loaded=loaded)

    if req.get("kill_trials"):
        kill_loop(make_engine, req["prompts"], params, req["kill_trials"])
        return
    engine = make_engine()
    for i, prompt in enumerate(req["prompts"]):
        out = engine.generate([prompt], params)[0]
        print(json.dumps({"i": i, "tokens": out.token_ids, "cached": out.num_cached_tokens,
                          "reused_from": out.reused_from, "plan": out.cache_plan}), flush=True)
    engine.close()


def kill_loop(make_engine, prompts, params, trials: int) -> None:
    """Fork writers and SIGKILL each at a random moment (after it has started writing)."""
    rng = random.Random(0)
    for trial in range(trials):
        pid = os.fork()
        if pid == 0:  # the child: generate with the disk cache until killed
            engine = make_engine()
            i = trial
            while True:
                engine.generate([prompts[i % len(prompts)]], params)
                i += 1
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(json.dumps({"trial": trial, "killed": pid}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
