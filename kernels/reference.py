"""Torch reference of every op statechat's model uses: the CPU path and the kernels' oracle.

All ops work on varlen batches packed along the token axis: sequence i owns tokens
`cu_seqlens[i]:cu_seqlens[i+1]`. Recurrent state lives in pools indexed by slot; per sequence a
source slot is read (slot 0 = "start from zeros") and a destination slot is written. Checkpoint
targets ask for the state after the first `boundary` tokens of a sequence's segment (a multiple
of `CHUNK`), written to a slot from inside the same pass.

The math runs in float32 (float64 when the inputs are float64, for use as an oracle). The
functions are written for clarity, with host-side loops over sequences; only the Triton kernels
need to be fast.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64  # GDN chunk size; checkpoint boundaries are multiples of it


class DecodeConv(NamedTuple):
    """A GDN layer's causal conv for one decode step, run by the projection before it
    (`linear`, `add_rmsnorm_linear`): output columns :D go through `causal_conv1d_update`.

    weight: [D, W]; conv_pool: [num_slots, W-1, D]; src_slots, dst_slots: [N] int32 (one per
    row; src 0 reads zeros; dst may equal src)
    """

    weight: torch.Tensor
    conv_pool: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor


@dataclass(frozen=True)
class Checkpoints:
    """Where states should be saved during a prefill: C targets.

    seq: [C] int32, index of the sequence in the batch
    boundary: [C] int32, tokens of that sequence's segment consumed, a positive multiple of CHUNK
        and at most the segment length
    slot: [C] int32, state slot to write
    """

    seq: torch.Tensor
    boundary: torch.Tensor
    slot: torch.Tensor

    def __len__(self) -> int:
        return int(self.seq.shape[0])

    def for_seq(self, i: int) -> list[tuple[int, int]]:
        """(boundary, slot) pairs of sequence i, host side."""
        return [
            (int(b), int(s))
            for q, b, s in zip(self.seq.tolist(), self.boundary.tolist(), self.slot.tolist())
            if q == i
        ]


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay and write strength of the gated delta rule.

    a, b: [T, HV]; A_log, dt_bias: [HV]. Returns g = -exp(A_log) * softplus(a + dt_bias) (log
    decay, <= 0) and beta = sigmoid(b), both [T, HV] in the math dtype.
    """
    dt = _math_dtype(a)
    g = -A_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt))
    return g, b.to(dt).sigmoid()


def _gdn_prepare(q, k, v, a, b, A_log, dt_bias):
    """Gate, normalise, scale and expand q/k to the value heads. Shapes as in chunk_gdn."""
    dt = _math_dtype(q)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    rep = v.shape[1] // q.shape[1]
    q = l2norm(q.to(dt)).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
    k = l2norm(k.to(dt)).repeat_interleave(rep, dim=1)
    return q, k, v.to(dt), g, beta


def _chunk_scan(q, k, v, g, beta, state, targets):
    """Chunked gated delta rule over one sequence.

    q, k: [T, HV, K]; v: [T, HV, V]; g, beta: [T, HV]; state: [HV, K, V] (math dtype).
    targets: {boundary: callback(state)} called with the state after `boundary` tokens.
    Returns (o [T, HV, V], final state).
    """
    T = q.shape[0]
    out = torch.empty_like(v)
    mask = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(0)
    for s in range(0, T, CHUNK):
        e = min(s + CHUNK, T)
        # [HV, L, *] views of this chunk
        qc, kc, vc = (x[s:e].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[s:e].transpose(0, 1), beta[s:e].transpose(0, 1)
        L = e - s
        gcum = gc.cumsum(-1)  # [HV, L]
        decay = (gcum[:, :, None] - gcum[:, None, :]).masked_fill(
            mask[:L, :L].T.logical_not(), float("-inf")
        ).exp()
        # Solve (I + A) u = beta * (v - exp(gcum) k S) with A strictly lower:
        # A_ij = beta_i k_i.k_j decay_ij
        kk = (kc @ kc.transpose(-1, -2)) * decay * bc[:, :, None]
        A = kk.tril(-1) + torch.eye(L, dtype=q.dtype, device=q.device)
        rhs = bc[:, :, None] * (vc - (kc * gcum.exp()[:, :, None]) @ state)
        u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        attn = (qc @ kc.transpose(-1, -2)) * decay  # causal incl. diagonal
        out[s:e] = ((qc * gcum.exp()[:, :, None]) @ state + attn @ u).transpose(0, 1)
        kdec = kc * (gcum[:, -1:] - gcum).exp()[:, :, None]
        state = state * gcum[:, -1].exp()[:, None, None] + kdec.transpose(-1, -2) @ u
        if e in targets:
            targets[e](state)
    return out, state


def chunk_layout(
    cu_seqlens: torch.Tensor, num_tokens: int, checkpoints: Checkpoints | None = None,
    pad_seqs: int = 0,
) -> object | None:
    """The bookkeeping `chunk_gdn` derives from cu_seqlens, the token count and the checkpoints,
    computed once for all the GDN layers of a step; pad_seqs: how many of the last sequences
    only pad a graph's shapes (little work: launch tuning may ignore them). The reference
    needs none (None)."""
    return None


def chunk_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    checkpoints: Checkpoints | None = None,
    layout: object | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Varlen chunked gated delta rule with fused gating and q/k L2 norm.

    q, k: [T, H, K]; v: [T, HV, V] (HV a multiple of H; value head j reads key head j // (HV/H));
    a, b: [T, HV] raw gate inputs; A_log, dt_bias: [HV];
    state_pool: [num_slots, HV, K, V] float32, read at src_slots and written at dst_slots
    (and at checkpoint slots); cu_seqlens: [N+1] int32; src_slots, dst_slots: [N] int32.
    layout: what `chunk_layout` returned for these cu_seqlens, T and checkpoints (shared by the
    layers of a step), or None. norm: (gate [T, HV, V], weight [V], eps), or None: with it,
    returns `gated_rmsnorm(o, gate, weight, eps)` (the layer's next op, fused where it can be).
    Returns o: [T, HV, V] in v's dtype.
    """
    qm, km, vm, g, beta = _gdn_prepare(q, k, v, a, b, A_log, dt_bias)
    out = torch.empty_like(vm)
    for i, (s, e) in enumerate(_bounds(cu_seqlens)):
        src, dst = int(src_slots[i]), int(dst_slots[i])
        state = state_pool[src].to(qm.dtype) if src != 0 else qm.new_zeros(state_pool.shape[1:])
        targets = {}
        for boundary, slot in (checkpoints.for_seq(i) if checkpoints is not None else []):
            targets[boundary] = lambda st, slot=slot: state_pool[slot].copy_(st)
        out[s:e], state = _chunk_scan(qm[s:e], km[s:e], vm[s:e], g[s:e], beta[s:e], state, targets)
        state_pool[dst].copy_(state)
    return out.to(v.dtype) if norm is None else gated_rmsnorm(out.to(v.dtype), *norm)


def recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the gated delta rule for N sequences (one token each).

    q, k: [N, H, K]; v: [N, HV, V]; a, b: [N, HV]; state_pool: [num_slots, HV, K, V] float32;
    src_slots, dst_slots: [N] int32. Returns o: [N, HV, V] in v's dtype.
    """
    qm, km, vm, g, beta = _gdn_prepare(q, k, v, a, b, A_log, dt_bias)
    src = src_slots.long()
    # slot 0 never read
    state = torch.where((src != 0)[:, None, None, None], state_pool[src].to(qm.dtype), 0.0)
    state = state * g.exp()[:, :, None, None]
    delta = beta[:, :, None] * (vm - torch.einsum("nhkv,nhk->nhv", state, km))
    state = state + km[:, :, :, None] * delta[:, :, None, :]
    out = torch.einsum("nhkv,nhk->nhv", state, qm)
    state_pool[dst_slots.long()] = state.to(state_pool.dtype)
    return out.to(v.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    checkpoints: Checkpoints | None = None,
) -> torch.Tensor:
    """Varlen causal depthwise conv1d (no bias) followed by SiLU.

    x: [T, D]; weight: [D, W]; conv_pool: [num_slots, W-1, D] holds the last W-1 inputs of each
    sequence (oldest first), read at src_slots (slot 0 = zeros) and written at dst_slots; a
    checkpoint target (boundary n) receives the window of inputs n-W+1 .. n-1.
    Returns [T, D] in x's dtype.
    """
    dt = _math_dtype(x)
    width = weight.shape[1]
    w = weight.to(dt)
    out = torch.empty(x.shape, dtype=dt, device=x.device)
    for i, (s, e) in enumerate(_bounds(cu_seqlens)):
        src, dst = int(src_slots[i]), int(dst_slots[i])
        init = conv_pool[src].to(dt) if src != 0 else x.new_zeros(width - 1, x.shape[1], dtype=dt)
        xs = torch.cat([init, x[s:e].to(dt)], dim=0)  # [W-1+L, D]
        windows = xs.unfold(0, width, 1)  # [L, D, W]
        out[s:e] = F.silu((windows * w).sum(-1))
        for boundary, slot in (checkpoints.for_seq(i) if checkpoints is not None else []):
            conv_pool[slot].copy_(xs[boundary : boundary + width - 1])
        conv_pool[dst].copy_(xs[xs.shape[0] - (width - 1) :])
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of causal_conv1d: x: [N, D] -> [N, D]; conv_pool as in causal_conv1d."""
    dt = _math_dtype(x)
    src = src_slots.long()
    init = torch.where((src != 0)[:, None, None], conv_pool[src].to(dt), 0.0)  # slot 0 never read
    xs = torch.cat([init, x.to(dt)[:, None, :]], dim=1)  # [N, W, D]
    out = F.silu((xs * weight.to(dt).T[None]).sum(1))
    conv_pool[dst_slots.long()] = xs[:, 1:].to(conv_pool.dtype)
    return out.to(x.dtype)


def gated_rmsnorm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x over its last dim, times weight, times SiLU(gate) (transformers' order).

    x, gate: [..., D]; weight: [D]. The norm runs in float32, the weight multiplies in x's dtype.
    """
    dt = _math_dtype(x)
    xf = x.to(dt)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(dt).mul(F.silu(gate.to(dt))).to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: norm(x) * (1 + weight), computed in float32. x: [..., D]."""
    dt = _math_dtype(x)
    xf = x.to(dt)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.to(dt))
    return out.to(x.dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); the sum is rounded to x's dtype before the norm."""
    total = x + residual
    return rmsnorm(total, weight, eps), total


def rmsnorm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each head, then rotary embedding of its first R channels.

    x: [T, H, D]; weight: [D]; cos, sin: [T, R] (R even, <= D; the rest passes through).
    The norm is rounded to x's dtype, then rotated in that dtype (torch's rounding per op).
    """
    x = rmsnorm(x, weight, eps)
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up output: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _conv_columns(y: torch.Tensor, conv: DecodeConv | None) -> torch.Tensor:
    if conv is not None:
        D = conv[0].shape[0]
        y[:, :D] = causal_conv1d_update(y[:, :D], *conv)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, conv: DecodeConv | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype. conv: a GDN layer's decode conv, run on
    output columns :D (the layer's q/k/v channels), or None."""
    return _conv_columns(F.linear(x, w), conv)


def add_rmsnorm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
    conv: DecodeConv | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) @ w^T, x + residual): the residual add and norm before a
    projection. x, residual: [M, K]; norm_w: [K]; w: [N, K]; conv as for `linear`."""
    normed, total = add_rmsnorm(x, residual, norm_w, eps)
    return _conv_columns(F.linear(normed, w), conv), total


def add_rmsnorm_logits(
    x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, argmax): the last residual add and norm, the lm_head, the logits as float32
    ([M, N], the projection rounded to x's dtype first) and their argmax ([M] int64, the first
    of equal maxima). x, residual: [M, K]; norm_w: [K]; w: [N, K]."""
    logits = add_rmsnorm_linear(x, residual, norm_w, eps, w)[0].float()
    return logits, logits.argmax(dim=-1)


def silu_mul_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up output, then a projection: silu_mul(x) [M, I] @ w [N, I]^T."""
    return F.linear(silu_mul(x), w)


def gated_rmsnorm_linear(
    x: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor
) -> torch.Tensor:
    """The GDN layer's gated norm of each head, then its output projection: x, gate
    [T, H, D]; norm_w [D]; w [N, H * D] -> [T, N]."""
    return F.linear(gated_rmsnorm(x, gate, norm_w, eps).reshape(x.shape[0], -1), w)


def copy_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i (src and dst: [M] int32, disjoint)."""
    pool[dst.long()] = pool[src.long()]


def advance_decode_inputs(
    tokens: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """A decode step's inputs, in place, turned into those of the step after it for the same
    sequences: each row that writes KV (slot_mapping >= 0) feeds tokens[i] (the token this step
    sampled) at the next position, into the next slot of its block, over one more key. Rows
    with slot_mapping -1 (padding) stay as they are. The caller guarantees that no row's next
    position starts a new block.

    tokens, ids, positions, slot_mapping: [B] int64; context_lens: [B] int32.
    """
    live = slot_mapping >= 0
    ids.copy_(torch.where(live, tokens, ids))
    positions.add_(live)
    slot_mapping.add_(live)
    context_lens.add_(live)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into the paged cache.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, block * block_size + offset for each token (-1 = skip).
    """
    keep = slot_mapping >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    flat_v[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The attention layer's step before attention: q and k normed and rotated, k and v stored.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; q_weight, k_weight: [D]; cos, sin: [T, R] as for
    `rmsnorm_rope`; k_cache, v_cache, slot_mapping as for `store_kv`. Writes
    rmsnorm_rope(k) and v into the caches; returns rmsnorm_rope(q) [T, Hq, D].
    """
    store_kv(rmsnorm_rope(k, k_weight, cos, sin, eps), v, k_cache, v_cache, slot_mapping)
    return rmsnorm_rope(q, q_weight, cos, sin, eps)


QUERY_TILE = 256  # paged_attention's queries a pass: its scores stay [Hq, 256, context]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over a paged KV cache (prefill and decode alike).

    q: [T, Hq, D] (Hq a multiple of Hkv); k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [N, max_blocks] int32; cu_seqlens_q: [N+1] int32; context_lens: [N] int32,
    tokens in the cache for each sequence including its new ones (which are its last tokens);
    gate: None or [T, Hq, D] of q's dtype (token and head strides free, unit-stride last dim),
    Qwen3.5's output gate: the result, rounded to q's dtype, times sigmoid(gate).
    Returns [T, Hq, D] in q's dtype; softmax in float32.
    """
    dt = _math_dtype(q)
    block_size = k_cache.shape[1]
    rep = q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=dt, device=q.device)
    for i, (s, e) in enumerate(_bounds(cu_seqlens_q)):
        n_ctx = int(context_lens[i])
        n_blocks = (n_ctx + block_size - 1) // block_size
        blocks = block_tables[i, :n_blocks].long()
        keys = (k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n_ctx].to(dt)
                .repeat_interleave(rep, dim=1))
        vals = (v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n_ctx].to(dt)
                .repeat_interleave(rep, dim=1))
        first = n_ctx - (e - s)  # the position of the sequence's first new token
        for t0 in range(s, e, QUERY_TILE):  # (a tile's scores at a time: memory, not FLOPs)
            t1 = min(e, t0 + QUERY_TILE)
            n_keys = first + t1 - s  # the keys its last query sees; later ones are all masked
            scores = torch.einsum("thd,shd->hts", q[t0:t1].to(dt), keys[:n_keys]) * scale
            q_pos = torch.arange(first + t0 - s, first + t1 - s, device=q.device)
            causal = torch.arange(n_keys, device=q.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~causal[None], float("-inf"))
            probs = scores.float().softmax(-1).to(dt)
            out[t0:t1] = torch.einsum("hts,shd->thd", probs, vals[:n_keys])
    out = out.to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts, weighted and summed over each token's top-k choices.

    x: [T, H]; w_gate_up: [E, 2I, H] (expert e's gate rows 0..I-1, then its up rows, as
    transformers stores `experts.gate_up_proj`); w_down: [E, H, I]; topk_ids: [T, K] int
    (int32 or int64, values in [0, E)); topk_weights: [T, K] float, any dtype.
    Returns [T, H] in x's dtype:
        out[t] = sum_k topk_weights[t, k] * w_down[e] @ (silu(g) * u),  e = topk_ids[t, k],
        (g, u) = split(w_gate_up[e] @ x[t]).
    The math runs in float32 (float64 for float64 x); the activation silu(g) * u is rounded to
    x's dtype before the down projection (as a model in that dtype computes it).
    """
    dt = _math_dtype(x)
    T, K = topk_ids.shape
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=dt, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).to(dt)
    tokens = torch.arange(T, device=x.device).repeat_interleave(K)
    for e in flat_ids.unique().tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        t = tokens[pairs]
        h = x[t].to(dt) @ w_gate_up[e].to(dt).T  # [n, 2I]
        act = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).to(dt)
        y = act @ w_down[e].to(dt).T  # [n, H]
        out.index_add_(0, t, y * flat_w[pairs, None])
    return out.to(x.dtype)


# --- sampling ---------------------------------------------------------------------------
# A row's sampling values, as statechat.engine.sampling.Rows packs them: [R, 6] float32 of
# temperature (1 for an argmax), top-p (inf: off), log min-p (-inf: off), repetition,
# frequency and presence penalties (1, 0, 0: off).


def penalize_logits(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts_rows: torch.Tensor,
    params: torch.Tensor,
    counts: torch.Tensor | None,
    in_prompt: torch.Tensor | None,
    width: int,
) -> torch.Tensor:
    """Rows `rows` [R] (int64) of logits [M, V] under their penalties and temperature, as
    float32 [R, width >= V] whose columns past V are -inf (padding for a chunked top-k).

    counts [C, V] int32: each penalised request's generated-token counts, in_prompt [C, V]
    bool: its prompt's tokens, row counts_rows[r] (int64) for row r (None: no penalties this
    step). vLLM's order: the repetition penalty divides the positive (multiplies the negative)
    logits of tokens in the prompt or generated; frequency x count and presence x (count > 0)
    are subtracted; then the temperature divides."""
    x = logits.index_select(0, rows).float()
    if counts is not None:
        c = counts.index_select(0, counts_rows)
        generated = c > 0
        seen = in_prompt.index_select(0, counts_rows) | generated
        r = params[:, 3:4]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - params[:, 4:5] * c
        x = x - params[:, 5:6] * generated
    x = x / params[:, 0:1]
    if width > x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=float("-inf"))
    return x


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys [R, V] of float32 values x [R, V] whose descending order is the kernels':
    larger values first, equal ones by column (the lower first). The value's bits made
    order-preserving as a signed int (the negative ones' flipped) over 2**31 - 1 - the column,
    so that one top-k of the keys gives the values and their columns together."""
    bits = x.float().contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    column = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (ordered << 32) | (0x7FFFFFFF - column)


def key_columns(keys: torch.Tensor) -> torch.Tensor:
    """The columns (int64) order_keys' keys were made at."""
    return 0x7FFFFFFF - (keys & 0xFFFFFFFF)


def ranked_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [R, V] (float32), largest first, and their columns
    ([R, k] each), equal values in column order, the lower columns taken first at the k-th
    place: the kernels' order, whatever k. (torch's topk orders equal values as its k happens
    to make it: a seeded draw under top-p, or a logprob table's likeliest tokens, then moved
    with the k of the other rows of a step.)"""
    cols = key_columns(order_keys(x).topk(k, dim=-1).values)
    return x.gather(1, cols), cols


def candidate_probs(
    values: torch.Tensor, top_k: torch.Tensor, params: torch.Tensor
) -> torch.Tensor:
    """The probabilities [R, K] each row draws from among its K likeliest tokens, whose
    (penalised, temperature-scaled) logits `values` [R, K] come largest first: the first
    top_k [R] (int64) kept, then min-p, then top-p (a token is dropped once those before it
    reach top-p), vLLM's order; the others get 0."""
    x = values.masked_fill(torch.arange(values.shape[-1], device=values.device) >= top_k[:, None],
                           float("-inf"))
    x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + params[:, 2:3], float("-inf"))
    probs = x.softmax(-1)
    return probs.masked_fill(probs.cumsum(-1) - probs >= params[:, 1:2], 0.0)


def draw_candidates(
    values: torch.Tensor,
    cols: torch.Tensor,
    noise: torch.Tensor,
    top_k: torch.Tensor,
    params: torch.Tensor,
) -> torch.Tensor:
    """One token [R] (int64) per row, drawn among its candidates: values [R, K] and their token
    ids cols [R, K] (int64) as candidate_probs takes them, noise [R, K] exponential(1) draws
    (the token is the argmax of probability / noise: a draw from the probabilities).

    The draws go to a row's candidates by token id, not by rank: of the first top_k whose
    value is finite, the one with the j-th smallest id takes noise[:, j] (candidate_ranks).
    Two candidates whose logits nearly tie, and swap places with the rounding of another
    batch, so keep their draws (handed out by rank, the same draws fell on other tokens, and
    a seeded row's tokens changed with its batch)."""
    probs = candidate_probs(values, top_k, params)
    past = torch.arange(values.shape[-1], device=values.device) >= top_k[:, None]
    ranks = candidate_ranks(cols, ~past & (values > float("-inf")))
    return cols.gather(1, (probs / noise.gather(1, ranks)).argmax(dim=-1, keepdim=True))[:, 0]


def candidate_ranks(cols: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """The rank [R, K] (int64) of each of a row's `ranked` [R, K] (bool) candidates' token ids
    cols [R, K] among them (0: the smallest id); the others follow, in their own order (which
    ids fill the places of a row's -inf candidates so moves no draw)."""
    place = torch.arange(cols.shape[-1], device=cols.device)
    keyed = torch.where(ranked, cols, cols.new_full((), 2**62) + place)
    return keyed.argsort(dim=-1).argsort(dim=-1)


def sample_top_k(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts_rows: torch.Tensor,
    params: torch.Tensor,
    counts: torch.Tensor | None,
    in_prompt: torch.Tensor | None,
    top_k: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """One token [R] per row drawn among its top-k tokens, from the logits on: penalize_logits,
    the K likeliest of each row (K = noise.shape[1], at least every row's top_k), then
    draw_candidates with that noise [R, K]. Arguments as those two take them."""
    x = penalize_logits(logits, rows, counts_rows, params, counts, in_prompt, logits.shape[-1])
    values, cols = ranked_top_k(x, noise.shape[-1])
    return draw_candidates(values, cols, noise, top_k, params)


def vocabulary_probs(
    x: torch.Tensor, params: torch.Tensor, top_p: bool | None = None
) -> torch.Tensor:
    """The probabilities [R, V] each row of (penalised, temperature-scaled) logits x [R, V]
    draws from under its min-p and top-p (params as penalize_logits takes them), vLLM's order:
    min-p drops the tokens whose logit is below the largest + log min-p; top-p then keeps the
    smallest set reaching its mass, in a stable descending sort (among equal logits the
    lower token id first): a token is dropped once those before it reach top-p. `top_p`:
    whether some row has one (None: read from params, which waits for the device)."""
    x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + params[:, 2:3], float("-inf"))
    probs = x.softmax(-1)
    if top_p or (top_p is None and bool((params[:, 1] < 1).any())):
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)
        drop = ranked.cumsum(-1) - ranked >= params[:, 1:2]
        probs = probs.scatter(1, order, ranked.masked_fill(drop, 0.0))
    return probs


def sample_vocabulary(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts_rows: torch.Tensor,
    params: torch.Tensor,
    counts: torch.Tensor | None,
    in_prompt: torch.Tensor | None,
    noise: torch.Tensor,
) -> torch.Tensor:
    """One token [R] per row drawn over the whole vocabulary, from the logits on:
    penalize_logits, then vocabulary_probs (min-p, top-p; no top-k), then the argmax of
    probability over noise [R, V] (exponential(1) draws). Arguments as penalize_logits takes
    them. (The Triton kernels find the top-p set without a sort and rank the race by
    x - log(noise) or exp(x - max) / noise; their sums and quotients may round otherwise,
    which moves a token on the edge of the set, or one of two nearly equal race values.)
    Off the CPU it sorts whatever the top-p: reading the params would wait for the device."""
    x = penalize_logits(logits, rows, counts_rows, params, counts, in_prompt, logits.shape[-1])
    top_p = None if params.device.type == "cpu" else True
    return (vocabulary_probs(x, params, top_p) / noise).argmax(dim=-1)


def score_logits(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Prompt logprobs of R rows of logits [R, V] (any float dtype, unit column stride) and
    their target tokens [R] int64: [R, 2 + 2k] float32 of each target's log-probability, the k
    largest log-probabilities (largest first) and their token ids, then the target's rank (1 +
    the tokens whose logit exceeds its logit). Below -9999 (-inf included) a value is -9999,
    vLLM's stand-in for -inf, which JSON cannot carry; so is a NaN (a row without a finite
    logit). 0 <= k <= V."""
    x = logits.float()
    logp = x.log_softmax(-1)
    ids = ranked_top_k(x, k)[1]
    values = logp.gather(1, ids)
    rank = (x > x.gather(1, targets[:, None])).sum(1, keepdim=True).float() + 1
    table = torch.cat([logp.gather(1, targets[:, None]), values, ids.float(), rank], 1)
    return table.nan_to_num_(nan=-9999.0).clamp_min_(-9999.0)
