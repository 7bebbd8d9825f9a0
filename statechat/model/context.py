"""Per-step metadata handed to the model, and the state caches it reads and writes.

The engine builds one `Context` per forward step; the model only reads it. The caches are plain
tensors owned by the engine's pools; the model sees slot and block indices, nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kernels.reference import Checkpoints
from statechat.model.config import ModelConfig


@dataclass
class Context:
    """Metadata of one forward step over N sequences and T new tokens (packed).

    positions: [T] int64, absolute position of each token in its sequence
    cu_seqlens: [N+1] int32, token offsets of the sequences in the packed batch
    is_decode: every sequence has exactly one new token (GDN uses its recurrent ops)
    state_src: [N] int32, GDN state slot to start from (0 = zeros)
    state_dst: [N] int32, GDN state slot to leave the final state in
    checkpoints: GDN states to save at block boundaries inside this step, or None
    slot_mapping: [T] int64, KV cache position (block * block_size + offset) of each token
    block_tables: [N, max_blocks] int32, KV blocks of each sequence, in order
    context_lens: [N] int32, tokens in the KV cache for each sequence after this step
    logits_indices: [M] int64, rows of the packed batch whose logits are returned (None = all)
    logits_seqs: [M] int64, the sequence of each logits row, given only when each row is the
    last of its sequence in the step (no sequence has two; a sequence may have none): then
    nothing reads the other rows' outputs of the last layer, which runs its attention queries,
    output projection and feed-forward on the logits rows alone (TextModel.forward returns
    only those rows). None: every row runs the whole model
    gdn_layout: the GDN kernels' chunk bookkeeping for this step (kernels.chunk_layout), made
    by the model at the start of every forward and shared by its GDN layers
    pad_seqs: how many of the last sequences only pad a CUDA graph's shapes (launch tuning
    counts the others)
    rope_table: [P, 2 rotary_dim] cos | sin of positions 0 .. P-1 in the model dtype
    (RotaryEmbedding.build_table), P past every position of the step; None: computed from the
    positions. The engine's own: a table the model holds may be another engine's, shorter
    """

    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    is_decode: bool
    state_src: torch.Tensor
    state_dst: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    checkpoints: Checkpoints | None = None
    logits_indices: torch.Tensor | None = None
    logits_seqs: torch.Tensor | None = None
    gdn_layout: object | None = None
    pad_seqs: int = 0
    rope_table: torch.Tensor | None = None


@dataclass
class ModelCaches:
    """State tensors of every layer.

    conv: per GDN layer [num_slots, W-1, conv_dim] in the model dtype (slot 0 stays zero)
    ssm: per GDN layer [num_slots, HV, K, V] float32 (slot 0 stays zero)
    k, v: per attention layer [num_blocks, block_size, Hkv, head_dim] in the model dtype
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> ModelCaches:
        """Zero-filled caches for `num_slots` GDN state slots and `num_blocks` KV blocks."""
        c = config
        conv_shape = (num_slots, c.linear_conv_kernel_dim - 1, c.conv_dim)
        ssm_shape = (num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                     c.linear_value_head_dim)
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        n_gdn, n_attn = len(c.gdn_layers), len(c.attn_layers)
        return cls(
            conv=[_zeros(conv_shape, dtype, device) for _ in range(n_gdn)],
            ssm=[_zeros(ssm_shape, torch.float32, device) for _ in range(n_gdn)],
            k=[_zeros(kv_shape, dtype, device) for _ in range(n_attn)],
            v=[_zeros(kv_shape, dtype, device) for _ in range(n_attn)],
        )

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one GDN state slot over all GDN layers (conv + recurrent)."""
        c = config
        conv = ((c.linear_conv_kernel_dim - 1) * c.conv_dim
                * torch.empty((), dtype=dtype).element_size())
        ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        return (conv + ssm) * len(c.gdn_layers)

    @staticmethod
    def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
        """Bytes of one KV block over all attention layers (keys + values)."""
        c = config
        per_layer = 2 * block_size * c.num_key_value_heads * c.head_dim
        return per_layer * len(c.attn_layers) * torch.empty((), dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. On the CPU its bytes come from calloc, whose pages the OS maps, zeroed,
    on first touch: a cache budget that a small model never fills costs neither a fill of every
    byte at start (0.4 s a GiB) nor resident memory. 64-byte aligned, as torch's own."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(n + 64, dtype=np.uint8))
    start = -raw.data_ptr() % 64
    return raw[start:start + n].view(dtype).view(shape)
