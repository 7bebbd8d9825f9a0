"""statechat's ops for Qwen3.5: Triton kernels with torch references (kernels.reference).

Every public op here has the name and signature of its reference in `kernels/reference.py`
and dispatches on the backend:
- "auto" (default): the Triton kernel when the op's first tensor is on cuda or npu, the torch
  reference otherwise (the CPU path);
- "triton": always the Triton kernel (on CPU tensors it runs under TRITON_INTERPRET=1);
- "reference": always the torch reference.
The backend is read once from `STATECHAT_KERNELS` at import and changed with `set_backend`.
Triton modules are imported on first use, so the CPU path never imports triton. The GDN kernel
modules may be absent while they are written: then their ops fall back to the reference (any
other import error is raised).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

from kernels import reference
from kernels.reference import CHUNK, Checkpoints, DecodeConv

BACKENDS = ("auto", "triton", "reference")
_ACCELERATORS = frozenset({"cuda", "npu"})
# op name -> module holding its Triton launcher (a function of the same name)
_TRITON_MODULES = {
    "causal_conv1d": "kernels.conv1d",
    "causal_conv1d_update": "kernels.conv1d",
    "chunk_gdn": "kernels.gdn_chunk",
    "chunk_layout": "kernels.gdn_chunk",
    "recurrent_gdn": "kernels.gdn_recurrent",
    "gated_rmsnorm": "kernels.norms",
    "rmsnorm": "kernels.norms",
    "add_rmsnorm": "kernels.norms",
    "silu_mul": "kernels.activation",
    "linear": "kernels.gemv",
    "add_rmsnorm_linear": "kernels.gemv",
    "add_rmsnorm_logits": "kernels.gemv",
    "silu_mul_linear": "kernels.gemv",
    "gated_rmsnorm_linear": "kernels.gemv",
    "rmsnorm_rope": "kernels.rope",
    "copy_slots": "kernels.slots",
    "store_kv": "kernels.slots",
    "advance_decode_inputs": "kernels.slots",
    "qk_norm_rope_store": "kernels.rope",
    "paged_attention": "kernels.attention",
    "fused_moe": "kernels.moe",
    "penalize_logits": "kernels.sampler",
    "draw_candidates": "kernels.sampler",
    "sample_top_k": "kernels.sampler",
    "sample_vocabulary": "kernels.sampler",
    "score_logits": "kernels.sampler",
}
_OPTIONAL_MODULES = frozenset({"kernels.gdn_chunk", "kernels.gdn_recurrent"})


def _checked(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}: use one of {', '.join(BACKENDS)}")
    return name


_backend = _checked(os.environ.get("STATECHAT_KERNELS", "auto").strip().lower() or "auto")
_triton_ops: dict[str, Callable] = {}


def set_backend(name: str) -> None:
    """Choose the backend of every op: "auto", "triton" or "reference"."""
    global _backend
    _backend = _checked(name)


def get_backend() -> str:
    """The backend set by `set_backend` or `STATECHAT_KERNELS` ("auto" by default)."""
    return _backend


def _load_triton(name: str) -> Callable:
    module_name = _TRITON_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name or module_name not in _OPTIONAL_MODULES:
            raise
        return getattr(reference, name)
    return getattr(module, name)


def implementation(name: str, device: torch.device | str) -> Callable:
    """The function that op `name` runs for tensors on `device` under the current backend."""
    if _backend == "reference" or (
        _backend == "auto" and torch.device(device).type not in _ACCELERATORS
    ):
        return getattr(reference, name)
    fn = _triton_ops.get(name)
    if fn is None:
        fn = _triton_ops[name] = _load_triton(name)
    return fn


def _pick(name: str, x: torch.Tensor) -> Callable:
    # hot path: two comparisons and a dict lookup
    if _backend == "reference" or (_backend == "auto" and x.device.type not in _ACCELERATORS):
        return getattr(reference, name)
    fn = _triton_ops.get(name)
    return fn if fn is not None else implementation(name, x.device)


def _same_contract(ref: Callable) -> Callable[[Callable], Callable]:
    """Give a dispatching wrapper its reference's docstring and signature."""
    return functools.wraps(ref, assigned=("__doc__", "__annotations__"))


@_same_contract(reference.causal_conv1d)
def causal_conv1d(x, weight, conv_pool, cu_seqlens, src_slots, dst_slots, checkpoints=None):
    return _pick("causal_conv1d", x)(
        x, weight, conv_pool, cu_seqlens, src_slots, dst_slots, checkpoints
    )


@_same_contract(reference.causal_conv1d_update)
def causal_conv1d_update(x, weight, conv_pool, src_slots, dst_slots):
    return _pick("causal_conv1d_update", x)(x, weight, conv_pool, src_slots, dst_slots)


@_same_contract(reference.chunk_layout)
def chunk_layout(cu_seqlens, num_tokens, checkpoints=None, pad_seqs=0):
    return _pick("chunk_layout", cu_seqlens)(cu_seqlens, num_tokens, checkpoints, pad_seqs)


@_same_contract(reference.chunk_gdn)
def chunk_gdn(
    q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, src_slots, dst_slots, checkpoints=None,
    layout=None, norm=None,
):
    return _pick("chunk_gdn", q)(
        q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, src_slots, dst_slots, checkpoints,
        layout, norm,
    )


@_same_contract(reference.recurrent_gdn)
def recurrent_gdn(q, k, v, a, b, A_log, dt_bias, state_pool, src_slots, dst_slots):
    return _pick("recurrent_gdn", q)(
        q, k, v, a, b, A_log, dt_bias, state_pool, src_slots, dst_slots
    )


@_same_contract(reference.gated_rmsnorm)
def gated_rmsnorm(x, gate, weight, eps):
    return _pick("gated_rmsnorm", x)(x, gate, weight, eps)


@_same_contract(reference.rmsnorm)
def rmsnorm(x, weight, eps):
    return _pick("rmsnorm", x)(x, weight, eps)


@_same_contract(reference.add_rmsnorm)
def add_rmsnorm(x, residual, weight, eps):
    return _pick("add_rmsnorm", x)(x, residual, weight, eps)


@_same_contract(reference.rmsnorm_rope)
def rmsnorm_rope(x, weight, cos, sin, eps):
    return _pick("rmsnorm_rope", x)(x, weight, cos, sin, eps)


@_same_contract(reference.silu_mul)
def silu_mul(x):
    return _pick("silu_mul", x)(x)


@_same_contract(reference.linear)
def linear(x, w, conv=None):
    return _pick("linear", x)(x, w, conv)


@_same_contract(reference.add_rmsnorm_linear)
def add_rmsnorm_linear(x, residual, norm_w, eps, w, conv=None):
    return _pick("add_rmsnorm_linear", x)(x, residual, norm_w, eps, w, conv)


@_same_contract(reference.add_rmsnorm_logits)
def add_rmsnorm_logits(x, residual, norm_w, eps, w):
    return _pick("add_rmsnorm_logits", x)(x, residual, norm_w, eps, w)


@_same_contract(reference.silu_mul_linear)
def silu_mul_linear(x, w):
    return _pick("silu_mul_linear", x)(x, w)


@_same_contract(reference.gated_rmsnorm_linear)
def gated_rmsnorm_linear(x, gate, norm_w, eps, w):
    return _pick("gated_rmsnorm_linear", x)(x, gate, norm_w, eps, w)


@_same_contract(reference.copy_slots)
def copy_slots(pool, src, dst):
    return _pick("copy_slots", pool)(pool, src, dst)


@_same_contract(reference.advance_decode_inputs)
def advance_decode_inputs(tokens, ids, positions, slot_mapping, context_lens):
    return _pick("advance_decode_inputs", ids)(tokens, ids, positions, slot_mapping, context_lens)


@_same_contract(reference.store_kv)
def store_kv(k, v, k_cache, v_cache, slot_mapping):
    return _pick("store_kv", k)(k, v, k_cache, v_cache, slot_mapping)


@_same_contract(reference.qk_norm_rope_store)
def qk_norm_rope_store(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slot_mapping):
    return _pick("qk_norm_rope_store", q)(
        q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slot_mapping
    )


@_same_contract(reference.paged_attention)
def paged_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, gate=None
):
    return _pick("paged_attention", q)(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, gate
    )


@_same_contract(reference.fused_moe)
def fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights):
    return _pick("fused_moe", x)(x, w_gate_up, w_down, topk_ids, topk_weights)


@_same_contract(reference.penalize_logits)
def penalize_logits(logits, rows, counts_rows, params, counts, in_prompt, width):
    return _pick("penalize_logits", logits)(
        logits, rows, counts_rows, params, counts, in_prompt, width
    )


@_same_contract(reference.draw_candidates)
def draw_candidates(values, cols, noise, top_k, params):
    return _pick("draw_candidates", values)(values, cols, noise, top_k, params)


@_same_contract(reference.sample_top_k)
def sample_top_k(logits, rows, counts_rows, params, counts, in_prompt, top_k, noise):
    return _pick("sample_top_k", logits)(
        logits, rows, counts_rows, params, counts, in_prompt, top_k, noise
    )


@_same_contract(reference.sample_vocabulary)
def sample_vocabulary(logits, rows, counts_rows, params, counts, in_prompt, noise):
    return _pick("sample_vocabulary", logits)(
        logits, rows, counts_rows, params, counts, in_prompt, noise
    )


@_same_contract(reference.score_logits)
def score_logits(logits, targets, k):
    return _pick("score_logits", logits)(logits, targets, k)


__all__ = [
    "BACKENDS",
    "CHUNK",
    "Checkpoints",
    "DecodeConv",
    "add_rmsnorm",
    "add_rmsnorm_linear",
    "add_rmsnorm_logits",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gdn",
    "chunk_layout",
    "copy_slots",
    "draw_candidates",
    "fused_moe",
    "gated_rmsnorm",
    "gated_rmsnorm_linear",
    "get_backend",
    "implementation",
    "linear",
    "paged_attention",
    "penalize_logits",
    "qk_norm_rope_store",
    "recurrent_gdn",
    "rmsnorm",
    "rmsnorm_rope",
    "sample_top_k",
    "sample_vocabulary",
    "score_logits",
    "set_backend",
    "silu_mul",
    "silu_mul_linear",
    "store_kv",
]
