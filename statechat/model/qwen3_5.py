"""Qwen3.5 causal LM (dense or MoE), written top-down with Hugging Face parameter names.

    Qwen3_5ForCausalLM
      model: TextModel
        embed_tokens
        layers[i]: DecoderLayer = input_layernorm -> (GatedDeltaNet | Attention) -> residual
                                  -> post_attention_layernorm -> (MLP | SparseMoeBlock)
                                  -> residual
        norm
      lm_head (tied to embed_tokens when the config says so)

Each residual add runs fused with the norm after it; for one row (decode at batch 1) the norm
runs fused with the projection after it too (kernels.add_rmsnorm_linear, the final norm with
the lm_head), SwiGLU with the down projection (kernels.silu_mul_linear), and the GDN layer's
gated norm with its output projection (kernels.gated_rmsnorm_linear).

The model is stateless: a step's per-sequence state comes in through a `Context` (slot and
block indices) and `ModelCaches` (the tensors), so a later chunk or a decode step continues
exactly where the previous step stopped.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from statechat.model.attention import Attention
from statechat.model.config import ModelConfig
from statechat.model.context import Context, ModelCaches
from statechat.model.gdn import GatedDeltaNet
from statechat.model.layers import MLP, RMSNorm, RotaryEmbedding
from statechat.model.moe import SparseMoeBlock


class Qwen3_5ForCausalLM(nn.Module):
    """Token ids in, next-token logits out."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """After loading: projections that share an input become one GEMM (see fuse_linears)."""
        for layer in self.model.layers:
            (layer.linear_attn if layer.is_gdn else layer.self_attn).fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, ctx: Context, caches: ModelCaches, with_argmax: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [T] -> float32 logits [M, vocab] for the rows in ctx.logits_indices (and,
        with_argmax, their argmax [M], which a decode step's lm_head GEMV finds as it goes)."""
        h, residual = self.model(input_ids, ctx, caches)
        rows = None if ctx.logits_seqs is not None else ctx.logits_indices  # (picked already)
        return self.logits(h, residual, rows, with_argmax)

    @torch.inference_mode()
    def logits(
        self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor | None = None,
        with_argmax: bool = False, raw: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The TextModel's output rows `rows` (None: all) -> float32 logits (see forward), or
        with `raw` in the model's dtype."""
        if rows is not None:  # rows are independent: pick them before the norm
            h, residual = h[rows], residual[rows]
        norm = self.model.norm  # the last residual add and norm, fused with the lm_head's GEMV
        w = self.lm_head.weight
        if with_argmax:
            return kernels.add_rmsnorm_logits(h, residual, norm.weight, norm.eps, w)
        logits, _ = kernels.add_rmsnorm_linear(h, residual, norm.weight, norm.eps, w)
        return logits if raw else logits.float()


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # left uninitialised (the checkpoint's weights replace it): initialising it drew
        # normal_ values, which on the meta device imports torch's compiler, 0.8 s of a start
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        gdn_index = {layer: i for i, layer in enumerate(config.gdn_layers)}
        attn_index = {layer: i for i, layer in enumerate(config.attn_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(config, gdn_index.get(i, attn_index.get(i)), t)
            for i, t in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(
        self, input_ids: torch.Tensor, ctx: Context, caches: ModelCaches
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual stream before it): the final norm adds the two.
        Every row's, or with ctx.logits_seqs those of ctx.logits_indices alone, in their order."""
        h = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(ctx.positions, h.dtype, ctx.rope_table)
        # made by every forward (a graph's capture must not inherit its warm-up's tensors)
        ctx.gdn_layout = None if ctx.is_decode else kernels.chunk_layout(
            ctx.cu_seqlens, input_ids.shape[0], ctx.checkpoints, ctx.pad_seqs)
        residual = None
        for layer in self.layers[:-1]:
            h, residual = layer(h, residual, cos_sin, ctx, caches)
        return self.layers[-1](h, residual, cos_sin, ctx, caches, last=True)


class DecoderLayer(nn.Module):
    """Pre-norm residual block whose token mixer is a GDN layer or a full-attention layer and
    whose feed-forward is a dense MLP or a sparse MoE block."""

    def __init__(self, config: ModelConfig, cache_index: int, layer_type: str) -> None:
        super().__init__()
        self.is_gdn = layer_type == "linear_attention"
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(config, cache_index)
        else:
            self.self_attn = Attention(config, cache_index)
        self.cache_index = cache_index
        if config.is_moe:  # (every layer of Qwen3.5-MoE is sparse)
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: Context, caches: ModelCaches,
        last: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, residual stream before it): the caller's next norm adds the two, so
        the residual adds cost no kernel of their own. `residual` is None for the first layer.

        The model's last layer (`last`) with ctx.logits_seqs: its token mixer still writes
        every row's keys and values or GDN state, but from there on only the logits rows run
        (for attention, from its queries on), and only they are returned. A prefill's other
        rows are most of its tokens: at 32k this skips one of the six attention layers'
        work."""
        mixer = self.linear_attn if self.is_gdn else self.self_attn
        i = self.cache_index
        # a GDN layer's decode conv runs with its in-projection (see GatedDeltaNet.mix)
        conv = mixer.decode_conv(ctx, caches.conv[i]) if self.is_gdn else None
        if residual is None:
            residual = h
            proj = kernels.linear(self.input_layernorm(h), mixer.w_first, conv)
        else:  # the norm runs fused with the projection after it (one kernel for a decode row)
            norm = self.input_layernorm
            proj, residual = kernels.add_rmsnorm_linear(
                h, residual, norm.weight, norm.eps, mixer.w_first, conv
            )
        picked = last and ctx.logits_seqs is not None
        if self.is_gdn:
            x = mixer.mix(proj, ctx, caches.conv[i], caches.ssm[i])
        else:
            x = mixer.mix(proj, cos_sin, ctx, caches.k[i], caches.v[i], picked)
        if picked:  # (attention picked its rows itself)
            rows = ctx.logits_indices
            x, residual = (x[rows] if self.is_gdn else x), residual[rows]
            if not len(rows):  # no row's logits wanted (a chunk in mid-prompt)
                return x, residual
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, SparseMoeBlock):
            x, residual = norm.add(x, residual)
            return self.mlp(x), residual
        gate_up, residual = kernels.add_rmsnorm_linear(
            x, residual, norm.weight, norm.eps, self.mlp.w_gate_up
        )
        return self.mlp.down(gate_up), residual
