"""Small building blocks of Qwen3.5: zero-centred RMSNorm, SwiGLU MLP, partial rotary embedding."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (`norm(x) * (1 + weight)`), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rmsnorm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel: a residual add and the next norm."""
        return kernels.add_rmsnorm(x, residual, self.weight, self.eps)


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One [sum of outputs, in] weight for linears that share an input: one GEMM instead of
    several. Each linear's weight becomes a view of its rows, so the HF names still address
    the loaded values and no memory is duplicated."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.register_buffer("w_gate_up", None, persistent=False)

    def fuse(self) -> None:
        self.w_gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(kernels.linear(x, self.w_gate_up))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest after the gate/up GEMM (which a decoder layer may run fused with its norm):
        SwiGLU and the down projection, one kernel for a decode row."""
        return kernels.silu_mul_linear(gate_up, self.down_proj.weight)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables of the rotary position embedding on the first `rotary_dim` channels of each
    head (the rotation itself runs fused with the q/k norms: `kernels.qk_norm_rope_store`).

    Qwen3.5's multimodal RoPE reduces to this for text, where the temporal, height and width
    positions of a token are all equal.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2), persistent=False)
        self.table: torch.Tensor | None = None  # [positions, 2 rotary_dim]: cos | sin
        if not self.inv_freq.is_meta:  # (built on the meta device, it is computed after
            self.reset_parameters()  # to_empty: a meta arange imports torch's compiler)

    def reset_parameters(self) -> None:
        """(Re)compute the inverse frequencies, e.g. after `to_empty` on a meta-built model."""
        r = self.rotary_dim
        steps = torch.arange(0, r, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq = 1.0 / (self.theta ** (steps / r))
        self.table = None

    def build_table(self, max_len: int, dtype: torch.dtype) -> torch.Tensor:
        """Tabulate cos and sin of positions 0 .. max_len-1 (the same values `cos_sin` computes):
        then a step gathers its rows in one kernel instead of computing them in several (the
        caller guarantees positions below max_len). Returns the table.

        The table only grows: one that covers max_len in `dtype` is kept. Several engines may
        share this model: the caller hands the returned table to its steps (Context.rope_table)
        and keeps it alive as long as the graphs that read its memory (a longer one built for
        another engine holds the same values in its first rows)."""
        table = self.table
        if table is None or table.dtype != dtype or len(table) < max_len:
            positions = torch.arange(max_len, device=self.inv_freq.device)
            self.table = torch.cat(self._compute(positions, dtype), dim=-1)
        return self.table

    def _compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, table: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, rotary_dim] in `dtype` for positions [T]: rows of `table` (a
        build_table of the caller's, covering every position: views of one tensor), else
        computed. Never the table this module holds: another engine over the model may have
        built it, shorter than the caller's positions."""
        if table is None or table.dtype != dtype:
            return self._compute(positions, dtype)
        rows = table[positions]
        return rows[:, : self.rotary_dim], rows[:, self.rotary_dim :]
