"""Sparse mixture-of-experts block of Qwen3.5-MoE, with Hugging Face parameter names.

    SparseMoeBlock
      gate: TopKRouter          weight [E, hidden]: softmax over E experts (float32), top-k,
                                renormalised to sum to 1 when the config says so
      experts: Experts          gate_up_proj [E, 2*I, hidden] (gate rows, then up rows),
                                down_proj [E, hidden, I]: SwiGLU per expert, weighted sum
                                (kernels.fused_moe)
      shared_expert: MLP        always on, scaled by sigmoid(shared_expert_gate(x))
      shared_expert_gate        [1, hidden]

The experts are stored fused (3D) as transformers saves them; the loader stacks checkpoints
that name each expert (`experts.{e}.gate_proj.weight` ...) into these tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from statechat.model.config import ModelConfig
from statechat.model.layers import MLP, fuse_linears


class TopKRouter(nn.Module):
    """Router: logits [T, E] -> (top-k weights [T, k] in x's dtype, expert ids [T, k] int64)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] in the model dtype -> (weights [T, k], ids [T, k]) as transformers."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class Experts(nn.Module):
    """The routed experts' weights, one 3D tensor per projection (transformers' layout)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; ids, weights: [T, k] -> [T, hidden]."""
        return kernels.fused_moe(x, self.gate_up_proj, self.down_proj, ids, weights)


class SparseMoeBlock(nn.Module):
    """Routed experts plus a gated shared expert; replaces the MLP of an MoE layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.has_shared = config.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.register_buffer("w_in", None, persistent=False)

    def fuse(self) -> None:
        """Router, shared-expert gate and shared expert gate/up read the same x: one GEMM."""
        if self.has_shared:
            s = self.shared_expert
            self.w_in = fuse_linears(self.gate, self.shared_expert_gate, s.gate_proj, s.up_proj)
            s.w_gate_up = self.w_in[self.num_experts + 1 :]
        else:
            self.w_in = self.gate.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        E = self.num_experts
        proj = F.linear(x, self.w_in)  # [T, E (+ 1 + 2 * shared)]
        weights, ids = self.gate.route(proj[:, :E])
        out = self.experts(x, ids, weights)
        if not self.has_shared:
            return out
        shared = self.shared_expert.down_proj(kernels.silu_mul(proj[:, E + 1 :]))
        return out + torch.sigmoid(proj[:, E : E + 1]) * shared
