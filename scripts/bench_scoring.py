"""What scoring a prompt costs on a GPU (prompt_logprobs; the server's echo with logprobs, as
lm-eval-harness's loglikelihood requests send, with max_tokens 0 here): statechat vs transformers on
bench_e2e's random-weight model (Qwen3.5's shapes at about 1B parameters, bf16).

    python3 bench_scoring.py [--layers 24] [--out DIR]      (run from scripts/)

Measured, ms per request on an idle engine (the best of two after a warm-up):
- an 8k-token prompt computed for its first token (the cold prefill of bench_e2e), and scored
  (max_tokens 0) with prompt_logprobs 0 and 5, by kernels.score_logits and by its torch
  reference;
- transformers' forward over the same prompt with the logits of every position, their
  log-softmax, each token's logprob and the 5 likeliest;
- 64 prompts of 512 tokens scored together (prompt_logprobs 1): tokens per second.
Our prompt logprobs are compared with transformers' (the largest difference is printed; both
run in bf16).
A markdown table is printed last and written to DIR/bench_scoring.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from bench_common import ids, model_args, row, sync, ttft, write_table
from bench_e2e import build_model

import kernels
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams


def scored_s(engine: LLMEngine, prompts: list[list[int]], k: int) -> tuple[float, list]:
    """(seconds, outputs) of scoring the prompts together (max_tokens 0, prompt_logprobs k)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=k)
    sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t, outs


@torch.inference_mode()
def hf_scored_s(hf, prompt: list[int], k: int) -> tuple[float, torch.Tensor]:
    """transformers: every position's logits, their log-softmax, the tokens' logprobs and the k
    likeliest (in pieces of 1024 positions, as a server would, to bound the float32 copy)."""
    x = torch.tensor([prompt], device="cuda")
    sync()
    t = time.perf_counter()
    logits = hf(input_ids=x, use_cache=False, logits_to_keep=0).logits[0, :-1]
    chosen, tops = [], []
    for a in range(0, logits.shape[0], 1024):
        logp = logits[a : a + 1024].float().log_softmax(-1)
        chosen.append(logp.gather(1, x[0, a + 1 : a + 1025, None]))
        tops.append(logp.topk(k).values)
    chosen = torch.cat(chosen)[:, 0]
    torch.cat(tops).tolist()
    chosen = chosen.cpu()
    return time.perf_counter() - t, chosen


def main() -> None:
    args = model_args()
    path = Path("/tmp/statechat-e2e")
    hf = build_model(path, args.layers)
    engine = LLMEngine(EngineConfig(model=path, device="cuda", enable_prefix_cache=False,
                                    memory_fraction=0.4, max_model_len=9216, max_num_seqs=128,
                                    max_num_batched_tokens=8192))
    prompt = ids(8192, 3)
    ttft(engine, ids(8192, 1))  # compile every kernel at these shapes
    for k in (0, 5):  # (each k compiles its own kernels)
        scored_s(engine, [ids(8192, 2)], k)
    cold = min(ttft(engine, ids(8192, 4 + i)) for i in range(2))
    row("8k prompt, first token (cold prefill, ms)", f"{cold * 1e3:.1f}")
    outs = None
    for k in (0, 5):
        t, outs = min((scored_s(engine, [prompt], k) for _ in range(2)), key=lambda r: r[0])
        row(f"8k prompt scored, prompt_logprobs {k} (ms)", f"{t * 1e3:.1f}", "",
            f"{t / cold:.2f}x the cold prefill")
    fused, kernels.score_logits = kernels.score_logits, kernels.reference.score_logits
    scored_s(engine, [prompt], 5)
    torch_s = min(scored_s(engine, [prompt], 5)[0] for _ in range(2))
    kernels.score_logits = fused
    row("8k prompt scored, prompt_logprobs 5, torch's ops (the reference) (ms)",
        f"{torch_s * 1e3:.1f}", "", f"{torch_s / cold:.2f}x the cold prefill")
    hf_scored_s(hf, prompt, 5)
    theirs, chosen = min((hf_scored_s(hf, prompt, 5) for _ in range(2)), key=lambda r: r[0])
    ours = torch.tensor([e[0] for e in outs[0].prompt_logprobs[1:]])
    row("8k prompt scored, 5 likeliest (ms)", f"{t * 1e3:.1f}", f"{theirs * 1e3:.1f}",
        f"ratio {t / theirs:.2f}; logprobs differ by at most {(ours - chosen).abs().max():.3f} "
        "(bf16 both)")
    many = [ids(512, 100 + i) for i in range(64)]
    scored_s(engine, many, 1)
    t, _ = min((scored_s(engine, many, 1) for _ in range(2)), key=lambda r: r[0])
    row("64 prompts of 512 tokens scored together (tokens/s)", f"{64 * 512 / t:,.0f}", "",
        f"{t * 1e3:.1f} ms")
    write_table(args.out, "bench_scoring")


if __name__ == "__main__":
    main()
