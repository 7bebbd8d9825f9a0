"""Gated full attention of Qwen3.5 over a paged KV cache.

q/k RMSNorm per head, partial RoPE, grouped KV heads, and a sigmoid output gate that comes out
of q_proj interleaved with the queries (per head: D query channels, then D gate channels),
applied by the attention kernel. The decoder layer runs the q/k/v projection (fused with its
norm) and `mix` the rest.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from statechat.model.config import ModelConfig
from statechat.model.context import Context
from statechat.model.layers import RMSNorm, fuse_linears


class Attention(nn.Module):
    """One full-attention layer; `cache_index` selects its KV cache among the attention layers."""

    def __init__(self, config: ModelConfig, cache_index: int) -> None:
        super().__init__()
        c = config
        self.cache_index = cache_index
        self.num_heads, self.num_kv_heads, self.head_dim = (c.num_attention_heads,
                                                            c.num_key_value_heads, c.head_dim)
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.register_buffer("w_qkv", None, persistent=False)

    def fuse(self) -> None:
        self.w_qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    @property
    def w_first(self) -> torch.Tensor:
        """The q/k/v projection's fused weight, which the decoder layer runs (with the norm
        before it) ahead of `mix`."""
        return self.w_qkv

    def mix(
        self,
        proj: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx: Context,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        picked: bool = False,
    ) -> torch.Tensor:
        """The layer after its q/k/v projection: proj [T, 2 Hq D + 2 Hkv D] -> [T, hidden], or
        with `picked` [M, hidden] for the rows of ctx.logits_indices alone (see
        Context.logits_seqs), which attend as the last token of their sequences: a decode
        step's attention. Every row's keys and values are stored either way."""
        T = proj.shape[0]
        kv_dim = self.num_kv_heads * self.head_dim
        qg, k, v = proj.split([2 * self.num_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        q, gate = qg.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # one eps for both norms: q_norm's and k_norm's are the config's rms_norm_eps
        q = kernels.qk_norm_rope_store(  # writes the rotated k and v into the caches
            q, k, v, self.q_norm.weight, self.k_norm.weight, *cos_sin, self.q_norm.eps,
            k_cache, v_cache, ctx.slot_mapping,
        )
        tables, cu, lens = ctx.block_tables, ctx.cu_seqlens, ctx.context_lens
        if picked:
            rows, seqs = ctx.logits_indices, ctx.logits_seqs
            T = rows.shape[0]
            if not T:
                return proj.new_empty(0, self.o_proj.weight.shape[0])
            q, gate, tables, lens = q[rows], gate[rows], tables[seqs], lens[seqs]
            cu = torch.arange(T + 1, dtype=torch.int32, device=q.device)  # one query each
        o = kernels.paged_attention(  # gated in its epilogue: out * sigmoid(gate)
            q, k_cache, v_cache, tables, cu, lens, self.scale, gate
        )
        return kernels.linear(o.reshape(T, -1), self.o_proj.weight)
