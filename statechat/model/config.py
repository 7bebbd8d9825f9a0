"""ModelConfig: the text-model fields of a Qwen3.5 checkpoint, read once from config.json
(and its end-of-sequence ids and recommended sampling from generation_config.json).

This is the only module that reads a Hugging Face `config.json`; layers take a ModelConfig and
never look at the raw dict.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from statechat.errors import ModelError, first_line
from statechat.model.config_checks import check_fields, flag, layer_types, need, number, width
from statechat.model.generation_config import eos_ids, read_generation_config, sampling_defaults

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # text model under `text_config`
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob")


@dataclass(frozen=True)
class ModelConfig:
    """Flattened Qwen3.5 text-model configuration (dense or mixture-of-experts)."""

    model_type: str  # "qwen3_5[_moe]" (multimodal layout) or "qwen3_5[_moe]_text"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (0 in an MoE model: its every layer is sparse)
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention" per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    eos_token_ids: tuple[int, ...] = field(default=())
    # the checkpoint's recommended sampling, (key, value) pairs of the keys of
    # generation_config.GENERATION_SAMPLING: the defaults of requests that leave those fields out
    sampling_defaults: tuple[tuple[str, float | int], ...] = field(default=())
    torch_dtype: str = "bfloat16"  # dtype the weights are stored in
    # mixture of experts (num_experts == 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # width of each routed expert's SwiGLU
    shared_expert_intermediate_size: int = 0  # width of the always-on shared expert (0 = none)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # (Every layer of Qwen3.5-MoE is sparse, as transformers and vLLM build it: the
    # `decoder_sparse_step` and `mlp_only_layers` of Qwen2/3-MoE configs are not read.)

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model (every layer routes tokens to experts)."""
        return self.num_experts > 0

    @property
    def is_multimodal_layout(self) -> bool:
        """Checkpoint tensors of the text model live under `model.language_model.`."""
        return self.model_type in MULTIMODAL_MODEL_TYPES

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k and v projections side by side."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def fingerprint_fields(self) -> dict:
        """The fields that change the numbers a model computes (for cache fingerprints)."""
        d = asdict(self)
        d.pop("eos_token_ids")
        d.pop("sampling_defaults")
        if not self.is_moe:  # a dense model keeps the fingerprint it had before MoE support
            for key in MOE_FIELDS:
                d.pop(key)
        return d

    def digest(self) -> str:
        return hashlib.sha256(
            json.dumps(self.fingerprint_fields(), sort_keys=True).encode()
        ).hexdigest()

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (a checkpoint directory) into a ModelConfig."""
        path = Path(path)
        cfg_file = path / "config.json"
        if path.exists() and not path.is_dir():
            raise ModelError(f"{path} is a file, not a model directory (a Hugging Face "
                             "checkpoint directory with config.json)")
        if not path.is_dir():
            raise ModelError(_missing(path))
        if not cfg_file.is_file():
            raise ModelError(f"{path} has no config.json; "
                             "is it a Hugging Face checkpoint directory?")
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ModelError(f"{cfg_file} is not valid JSON ({e.msg} at line {e.lineno})") from None
        except (UnicodeDecodeError, OSError) as e:
            raise ModelError(f"{cfg_file} cannot be read ({type(e).__name__})") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{cfg_file} must hold a JSON object")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(f"unsupported model_type {model_type!r} in {cfg_file}; statechat runs "
                             f"Qwen3.5 ({', '.join(SUPPORTED_MODEL_TYPES)})")
        text = raw.get("text_config") if model_type in MULTIMODAL_MODEL_TYPES else raw
        if not isinstance(text, dict):
            raise ModelError(f"{cfg_file} lacks the object text_config")
        try:
            return cls._from_text_fields(model_type, text, raw, path)
        except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as e:
            # (a field of another shape)
            why = first_line(e)
            raise ModelError(f"{cfg_file} has a field of an unexpected type or value "
                             f"({why})") from None

    @classmethod
    def _from_text_fields(cls, model_type: str, text: dict, raw: dict, path: Path) -> ModelConfig:
        """The config of the text model's fields `text` (`raw`, the whole config.json, or its
        text_config), with generation_config.json's. A field missing or of a bad value is a
        ModelError naming it; the fields are checked in a fixed order, so an error names the
        same first one every time. (A field of another type raises TypeError and its kin:
        from_hf words those.)"""
        cfg_file = path / "config.json"
        need_ = functools.partial(need, text, cfg_file)
        num_layers = need_("num_hidden_layers")
        types = layer_types(text, num_layers, cfg_file)
        rope = _rope(text, cfg_file)
        tie = raw.get("tie_word_embeddings")
        tie = flag(cfg_file, "tie_word_embeddings",
                   text.get("tie_word_embeddings") if tie is None else tie, False)
        gen = read_generation_config(path)
        mlp = _mlp_fields(model_type, text, need_, cfg_file)
        fields = dict(
            model_type=model_type,
            vocab_size=need_("vocab_size"),
            hidden_size=need_("hidden_size"),
            num_hidden_layers=num_layers,
            layer_types=types,
            rms_norm_eps=number(cfg_file, "rms_norm_eps", text.get("rms_norm_eps"), 1e-6),
            tie_word_embeddings=tie,
            **_attention_fields(text, rope, need_, cfg_file),
            **_gdn_fields(need_),
            # (a multimodal config's text_config may have none: then its top level's)
            eos_token_ids=eos_ids(gen, text if text.get("eos_token_id") is not None else raw,
                                  path),
            sampling_defaults=sampling_defaults(gen, path),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype")
                            or "bfloat16"),
            **mlp,
        )
        try:
            return cls(**fields)
        except ModelError as e:  # (fields that do not fit together: check_fields)
            raise ModelError(f"{cfg_file} {e}") from None

def _rope(text: dict, cfg_file: Path) -> dict:
    """The rotary parameters (`rope_parameters`, else the older `rope_scaling`; {} for none),
    whose rope_type must be "default"."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelError(f"{cfg_file} asks for rope_type {rope_type!r}, which statechat does "
                         "not support (only 'default', the checkpoints' own)")
    return rope


def _mlp_fields(model_type: str, text: dict, need, cfg_file: Path) -> dict:
    """The MLP's fields: a dense model's intermediate_size, or an MoE model's expert fields
    (its intermediate_size, unused since every layer is sparse, is 0)."""
    if "moe" not in model_type:
        return {"intermediate_size": need("intermediate_size")}
    return {
        "intermediate_size": 0,
        "num_experts": need("num_experts"),
        "num_experts_per_tok": need("num_experts_per_tok"),
        "moe_intermediate_size": need("moe_intermediate_size"),
        # (missing: transformers' 512, whose shared expert the checkpoint then holds)
        "shared_expert_intermediate_size": width(text, cfg_file,
                                                 "shared_expert_intermediate_size", 512),
        "norm_topk_prob": flag(cfg_file, "norm_topk_prob", text.get("norm_topk_prob"), True),
    }


def _attention_fields(text: dict, rope: dict, need, cfg_file: Path) -> dict:
    """The full-attention layers' fields; head_dim defaults to 256 (transformers' default, not
    hidden_size / heads), the rotary fields to the top level's where `rope` lacks them, then
    to transformers' defaults."""
    def rotary(key: str, default: float, most: float | None = None) -> float:
        value = rope.get(key)
        return number(cfg_file, key, text.get(key) if value is None else value, default, most)

    return {
        "num_attention_heads": need("num_attention_heads"),
        "num_key_value_heads": need("num_key_value_heads"),
        "head_dim": need("head_dim", 256),
        "rope_theta": rotary("rope_theta", 10000.0),
        "partial_rotary_factor": rotary("partial_rotary_factor", 0.25, most=1.0),
        "max_position_embeddings": need("max_position_embeddings", 32768),
    }


def _gdn_fields(need) -> dict:
    """The Gated DeltaNet layers' fields (the conv kernel 4 wide unless given)."""
    return {
        "linear_num_key_heads": need("linear_num_key_heads"),
        "linear_num_value_heads": need("linear_num_value_heads"),
        "linear_key_head_dim": need("linear_key_head_dim"),
        "linear_value_head_dim": need("linear_value_head_dim"),
        "linear_conv_kernel_dim": need("linear_conv_kernel_dim", 4),
    }


def transformers_config(path: Path):
    """transformers' own config of the checkpoint directory `path` (its config.json read by
    from_hf first), with which AutoTokenizer picks the tokenizer, checking every field (those
    statechat does not read too). A null field is read as a missing one, as from_hf reads it:
    transformers refuses a null number it would default (and a null full_attention_interval
    fails inside it)."""
    from transformers import AutoConfig

    def without_nulls(d: dict) -> dict:
        return {k: without_nulls(v) if isinstance(v, dict) else v
                for k, v in d.items() if v is not None}

    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return AutoConfig.for_model(**without_nulls(raw))


def _missing(path: Path) -> str:
    """The error for a --model that is not there; one written as a repo id (`Qwen/Qwen3.5-0.8B`,
    which vLLM would download) says where statechat looked and how to fetch it."""
    from statechat.paths import hf_hub_cache, is_repo_id

    if not is_repo_id(path):
        return f"model directory {path} does not exist"
    return (f"model directory {path} does not exist, nor is {path} in the Hugging Face cache "
            f"({hf_hub_cache()}); statechat does not download models: run `hf download {path}` "
            "first, or pass --model DIR with a checkpoint directory")

