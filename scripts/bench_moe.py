"""MoE benchmark on a GPU: statechat vs transformers on one random-weight Qwen3.5-MoE model.

    python3 scripts/bench_moe.py [--layers 8] [--prefill 8192] [--per-expert] [--out DIR]

The model has Qwen3.5-35B-A3B's layer shapes (hidden 2048, 256 experts of width 512, top-8, a
shared expert of 512, 16 query and 2 KV heads of 256, 16/32 GDN key/value heads of 128, vocab
248320) but only `--layers` layers in the 3:1 pattern, so that transformers' copy and ours fit
on one GPU together; bf16. Both run the same weights in the same process. Measured:
- the MoE block alone (fused experts, one layer's weights) at 1, 32 and 8192 tokens, ours
  (kernels.fused_moe) vs transformers' experts module;
- decode ms/token at batch 1 and ms/step at batch 32 (after 512-token prompts);
- cold prefill of `--prefill` tokens (time to first token).
A markdown table is printed last and written to DIR/bench_moe.md.
"""

from __future__ import annotations

import argparse
import os
import sys
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
    ttft,
    write_table,
)

PROMPT = 512  # prompt length before the decode measurements


def model_config(layers: int):
    """Qwen3.5-35B-A3B's text config with `layers` layers."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )


def build_model(out: Path, layers: int, per_expert: bool):
    """Random-weight Qwen3.5-MoE saved with transformers (our loader reads it back)."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen3_5MoeForCausalLM(model_config(layers)).to(torch.bfloat16).eval()
    hf.save_pretrained(out, save_original_format=per_expert)
    add_tokenizer(out)
    return hf


def cuda_ms(fn, n: int = 20) -> float:
    """Mean GPU wall time of fn() in ms, after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


@torch.inference_mode()
def bench_moe_block(hf) -> None:
    """One layer's routed experts at decode and prefill sizes: ours vs transformers'."""
    import kernels

    block = hf.model.layers[0].mlp
    experts = block.experts
    for T in (1, 32, 8192):
        x = torch.randn(T, experts.gate_up_proj.shape[2], device="cuda", dtype=torch.bfloat16)
        _, weights, topk = block.gate(x)
        args = (x, experts.gate_up_proj, experts.down_proj, topk, weights)
        ours = cuda_ms(lambda args=args: kernels.fused_moe(*args))
        theirs = cuda_ms(lambda x=x, topk=topk, weights=weights: experts(x, topk, weights))
        ref = experts(x, topk, weights).float()
        got = kernels.fused_moe(*args).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        row(
            f"routed experts, {T} tokens (ms)",
            f"{ours:.3f}",
            f"{theirs:.3f}",
            f"ratio {ours / theirs:.2f}; rel err vs transformers {err:.1e}",
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (3 GDN : 1 attention)")
    ap.add_argument("--prefill", type=int, default=8192, help="tokens of the cold prefill")
    ap.add_argument(
        "--per-expert",
        action="store_true",
        help="save one tensor per expert (the published layout) instead of fused ones",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine

    log(torch.cuda.get_device_name(), "torch", torch.__version__)
    path = Path("/tmp/statechat-moe")
    hf = build_model(path, args.layers, args.per_expert)
    log("transformers experts implementation:", hf.config._experts_implementation)
    params = sum(p.numel() for p in hf.parameters())
    log(f"params {params / 1e9:.2f} B ({args.layers} layers)")
    bench_moe_block(hf)

    engine = LLMEngine(
        EngineConfig(
            model=path,
            device="cuda",
            enable_prefix_cache=False,
            memory_fraction=0.4,
            max_model_len=args.prefill + 1024,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
        )
    )
    ttft(engine, ids(args.prefill, 1))  # compile every kernel at these shapes
    ours = min(ttft(engine, ids(args.prefill, 2 + i)) for i in range(2))
    theirs, _ = hf_prefill(hf, torch.tensor([ids(args.prefill, 99)], device="cuda"))
    row(
        f"cold prefill {args.prefill} tokens (ms)",
        f"{ours * 1e3:.1f}",
        f"{theirs * 1e3:.1f}",
        f"ratio {ours / theirs:.2f}",
    )
    for batch in (1, 32):
        ours = decode_rate(engine, [ids(PROMPT, 100 + i) for i in range(batch)], 65)[0] * 1e3
        x = torch.tensor([ids(PROMPT, 200 + i) for i in range(batch)], device="cuda")
        theirs = hf_decode_ms(hf, hf_prefill(hf, x)[1], steps=16)
        unit = "ms/token" if batch == 1 else "ms/step"
        row(
            f"decode batch {batch} after {PROMPT} ({unit})",
            f"{ours:.2f}",
            f"{theirs:.2f}",
            f"ratio {ours / theirs:.2f}; ours {batch / ours * 1e3:,.0f} tokens/s",
        )

    write_table(args.out, "bench_moe")


if __name__ == "__main__":
    main()
