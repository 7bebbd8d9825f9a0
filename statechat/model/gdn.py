"""Gated DeltaNet ("linear attention") layer of Qwen3.5, stateful through slot indices.

in_proj_qkv -> causal depthwise conv + SiLU -> split q, k, v -> gated delta rule (g from a,
A_log, dt_bias; beta from b; q/k L2-normalised; value heads grouped over key heads) -> gated
RMSNorm with z -> out_proj. Conv windows and recurrent states live in pools; a step reads each
sequence's source slot and writes its destination slot (and checkpoint slots, if asked). The
decoder layer runs in_proj (fused with its norm) and `mix` the rest.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from statechat.model.config import ModelConfig
from statechat.model.context import Context
from statechat.model.layers import fuse_linears


class GatedDeltaNet(nn.Module):
    """One GDN layer; `cache_index` selects its conv and recurrent pools among the GDN layers."""

    def __init__(self, config: ModelConfig, cache_index: int) -> None:
        super().__init__()
        c = config
        self.cache_index = cache_index
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.eps = c.rms_norm_eps
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim, groups=c.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.num_v_heads, bias=False)
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)
        self.splits = [c.conv_dim, c.value_dim, self.num_v_heads, self.num_v_heads]  # qkv, z, b, a
        self.register_buffer("w_in", None, persistent=False)

    def fuse(self) -> None:
        self.w_in = fuse_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    @property
    def w_first(self) -> torch.Tensor:
        """The in-projection's fused weight, which the decoder layer runs (with the norm before
        it) ahead of `mix`."""
        return self.w_in

    def decode_conv(self, ctx: Context, conv_pool: torch.Tensor) -> kernels.DecodeConv | None:
        """In a decode step, the conv that the in-projection runs (kernels.linear's `conv`: its
        q/k/v columns leave it convolved); None in a prefill."""
        if not ctx.is_decode:
            return None
        return kernels.DecodeConv(self.conv1d.weight.squeeze(1), conv_pool, ctx.state_src,
                                  ctx.state_dst)

    def mix(
        self, proj: torch.Tensor, ctx: Context, conv_pool: torch.Tensor, ssm_pool: torch.Tensor
    ) -> torch.Tensor:
        """The layer after its in-projection: proj [T, conv_dim + value_dim + 2 HV] ->
        [T, hidden]. In a decode step the projection ran with `decode_conv`, so its q/k/v
        columns are already convolved."""
        T = proj.shape[0]
        qkv, z, b, a = proj.split(self.splits, dim=-1)
        z = z.reshape(T, self.num_v_heads, self.head_v_dim)
        if not ctx.is_decode:
            qkv = kernels.causal_conv1d(
                qkv, self.conv1d.weight.squeeze(1), conv_pool, ctx.cu_seqlens, ctx.state_src,
                ctx.state_dst, ctx.checkpoints,
            )
        q, k, v = qkv.split([self.key_dim, self.key_dim, qkv.shape[1] - 2 * self.key_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        gdn_args = (q, k, v, a, b, self.A_log, self.dt_bias, ssm_pool)
        if ctx.is_decode:  # the gated norm runs with the output projection (one kernel per row)
            o = kernels.recurrent_gdn(*gdn_args, ctx.state_src, ctx.state_dst)
            w_norm, w_out = self.norm.weight, self.out_proj.weight
            return kernels.gated_rmsnorm_linear(o, z, w_norm, self.eps, w_out)
        # the gated norm runs inside the GDN's output kernel
        o = kernels.chunk_gdn(*gdn_args, ctx.cu_seqlens, ctx.state_src, ctx.state_dst,
                              ctx.checkpoints, ctx.gdn_layout, (z, self.norm.weight, self.eps))
        return kernels.linear(o.reshape(T, -1), self.out_proj.weight)
