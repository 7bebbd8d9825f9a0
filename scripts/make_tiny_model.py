"""Write a tiny random-weight Qwen3.5 checkpoint with transformers' own classes.

The checkpoint has the real file layout (config.json, safetensors, tokenizer files, chat
template), so the loader, tokenizer and chat code are exercised exactly as with a published
model. The weights are random: the text it produces is noise.

    python scripts/make_tiny_model.py OUT [--layout qwen3_5|qwen3_5_text] [--dtype bfloat16]
        [--shard-size 200KB] [--tie] [--seed 0] [--moe [--per-expert]]

`qwen3_5` writes `Qwen3_5ForConditionalGeneration` (text weights under
`model.language_model.`, a tiny vision tower under `model.visual.`) plus stray `mtp.*` tensors
as the published checkpoints carry; `qwen3_5_text` writes `Qwen3_5ForCausalLM` (weights under
`model.`).

`--moe` writes Qwen3.5-MoE instead (`Qwen3_5MoeForConditionalGeneration` or
`Qwen3_5MoeForCausalLM`: 8 experts, top-2, a shared expert) with the experts fused as
transformers holds them and the released checkpoints store them (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]); `--per-expert` writes them as one tensor per
expert and projection (`mlp.experts.{e}.gate_proj.weight` ...), transformers' default
`save_original_format` layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few sentences so that the byte-level BPE learns some merges; any text would do.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "statechat keeps the state of every conversation turn on disk.",
    "Hello! How are you today? I am fine, thank you for asking.",
    "Gated DeltaNet layers carry a recurrent state; attention layers carry keys and values.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "A user edits an earlier message and the chat resumes from the nearest checkpoint.",
]


def tiny_text_config(vocab_size: int, tie: bool) -> dict:
    """Text-model fields of a tiny Qwen3.5 (3 GDN layers : 1 attention layer, twice)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def tiny_moe_text_config(vocab_size: int, tie: bool) -> dict:
    """Text-model fields of a tiny Qwen3.5-MoE: the dense layout with every MLP sparse."""
    text = tiny_text_config(vocab_size, tie)
    del text["intermediate_size"]
    text.update(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    return text


def build_tokenizer(out: Path) -> int:
    """Train a small byte-level BPE with Qwen's special tokens; return its vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
        r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def build_model(layout: str, vocab_size: int, tie: bool, seed: int, moe: bool = False):
    """Instantiate the transformers model for `layout` (dense or MoE) with random weights."""
    import transformers

    torch.manual_seed(seed)
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    text = (tiny_moe_text_config if moe else tiny_text_config)(vocab_size, tie)
    if layout == "qwen3_5_text":
        config = getattr(transformers, f"{family}TextConfig")(**text)
        return getattr(transformers, f"{family}ForCausalLM")(config)
    vision = {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
        "out_hidden_size": 64, "num_position_embeddings": 16,
    }
    config_cls = getattr(transformers, f"{family}Config")
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    return getattr(transformers, f"{family}ForConditionalGeneration")(config)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a non-trivial value (norm weights and biases included).

    transformers initialises RMSNorm weights to zero and several vectors to constants, which
    would hide layout mistakes (a swapped norm still matches); small random values expose them.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=gen).log())
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1
                        + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def add_mtp_tensors(out: Path, hidden: int) -> None:
    """Add stray `mtp.*` tensors to the last shard, as published Qwen3.5 checkpoints carry."""
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        shard = max(set(index["weight_map"].values()))
    else:
        index, shard = None, "model.safetensors"
    tensors = load_file(out / shard)
    extra = {"mtp.fc.weight": torch.zeros(hidden, 2 * hidden),
             "mtp.norm.weight": torch.zeros(hidden)}
    tensors.update({k: v.to(next(iter(tensors.values())).dtype) for k, v in extra.items()})
    save_file(tensors, out / shard, metadata={"format": "pt"})
    if index is not None:
        index["weight_map"].update({k: shard for k in extra})
        index_path.write_text(json.dumps(index, indent=2))


def make_tiny_model(
    out: Path, layout: str = "qwen3_5", dtype: str = "bfloat16", shard_size: str | None = None,
    tie: bool = False, seed: int = 0, moe: bool = False, per_expert: bool = False,
) -> Path:
    """Write a tiny checkpoint to `out` and return it (MoE with `moe`; `per_expert` names each
    expert's tensors separately instead of transformers' fused 3D tensors)."""
    from transformers import GenerationConfig

    if per_expert and not moe:
        raise ValueError("per_expert needs moe")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    model = build_model(layout, vocab_size, tie, seed, moe)
    randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    if moe:  # transformers writes per-expert tensors unless told to keep its fused ones
        kwargs["save_original_format"] = per_expert
    model.save_pretrained(out, **kwargs)
    im_end = SPECIAL_TOKENS.index("<|im_end|>")
    GenerationConfig(eos_token_id=[im_end, 0], pad_token_id=0).save_pretrained(out)
    if layout == "qwen3_5":
        add_mtp_tensors(out, hidden=64)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layout", choices=["qwen3_5", "qwen3_5_text"], default="qwen3_5")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--shard-size", default=None, help="e.g. 200KB to write several shards")
    parser.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="write Qwen3.5-MoE (8 experts, top-2)")
    parser.add_argument("--per-expert", action="store_true",
                        help="with --moe: one tensor per expert and projection")
    args = parser.parse_args()
    if args.per_expert and not args.moe:
        parser.error("--per-expert needs --moe")
    path = make_tiny_model(args.out, args.layout, args.dtype, args.shard_size, args.tie, args.seed,
                           args.moe, args.per_expert)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
