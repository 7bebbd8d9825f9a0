"""The sampler's elementwise work in two kernels, where torch launches one kernel per op.

- `penalize_logits`: the rows' logits under their penalties and temperature, padded with -inf
  (one pass over the vocabulary; torch's ops take five to eight, each a launch).
- `draw_candidates`: a row's draw among its top-k candidates (top-k, min-p, softmax, top-p and
  the exponential race) in one program per row; torch's ops take about a dozen small launches.
- `sample_top_k`: both, from the logits on, for a top-k of at most 64 (two kernels).
- `score_logits`: prompt logprobs: each row's log-probability of a given token, its rank and
  the k likeliest, in one read of the logits (torch's log-softmax, top-k and comparison read
  and write a float32 copy of them several times).

The top-k between them stays torch's (statechat.engine.sampling.top_k): a sort or a selection
is where torch is already good. Contracts and shapes: kernels/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # vocabulary columns per program of penalize_logits
# (p_rows: the rows' values, [R, 6] as reference.py gives them. A kernel argument may not be
# called `params`: triton 3.6's launcher binds its arguments under that name.)


@triton.jit
def _penalized(logits, rows, counts_rows, p_rows, counts, in_prompt, i_r, o_v, V, stride_r,
               stride_cr, stride_l, stride_c, HAS_COUNTS: tl.constexpr):
    """Row i_r's logits at columns o_v under its penalties and temperature (-inf past V)."""
    m_v = o_v < V
    i_l = tl.load(rows + i_r * stride_r).to(tl.int64)
    # columns past V (padding) load as -inf and stay -inf through every step below
    b_x = tl.load(logits + i_l * stride_l + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
    if HAS_COUNTS:
        i_c = tl.load(counts_rows + i_r * stride_cr).to(tl.int64)
        b_c = tl.load(counts + i_c * stride_c + o_v, mask=m_v, other=0)
        b_p = tl.load(in_prompt + i_c * stride_c + o_v, mask=m_v, other=0)
        rep = tl.load(p_rows + i_r * 6 + 3)
        freq = tl.load(p_rows + i_r * 6 + 4)
        pres = tl.load(p_rows + i_r * 6 + 5)
        generated = b_c > 0
        seen = (b_p != 0) | generated
        b_x = tl.where(seen, tl.where(b_x > 0, b_x / rep, b_x * rep), b_x)
        b_x = b_x - freq * b_c.to(tl.float32)
        b_x = b_x - pres * generated.to(tl.float32)
    return b_x / tl.load(p_rows + i_r * 6)


@triton.jit
def _penalize_kernel(logits, rows, counts_rows, p_rows, counts, in_prompt, out, V, W,
                     stride_r, stride_cr, stride_l, stride_c, stride_o, HAS_COUNTS: tl.constexpr,
                     BLOCK: tl.constexpr):
    i_r, i_v = tl.program_id(0), tl.program_id(1)
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    b_x = _penalized(logits, rows, counts_rows, p_rows, counts, in_prompt, i_r, o_v, V, stride_r,
                     stride_cr, stride_l, stride_c, HAS_COUNTS)
    tl.store(out + i_r.to(tl.int64) * stride_o + o_v, b_x, mask=o_v < W)


def _check_penalize(logits: torch.Tensor, R: int, params: torch.Tensor,
                    counts: torch.Tensor | None, in_prompt: torch.Tensor | None) -> None:
    if logits.ndim != 2 or logits.stride(-1) != 1 or logits.dtype != torch.float32:
        raise ValueError(f"the sampler's kernels need logits [M, V] float32 with unit column "
                         f"stride, got {tuple(logits.shape)} {logits.dtype}")
    if params.shape != (R, 6) or params.dtype != torch.float32:
        raise ValueError(f"the sampler's kernels need params [{R}, 6] float32")
    if counts is not None and (counts.shape != in_prompt.shape
                               or counts.shape[-1] != logits.shape[-1]
                               or counts.dtype != torch.int32 or not counts.is_contiguous()
                               or not in_prompt.is_contiguous()):
        raise ValueError("the sampler's kernels need counts [C, V] int32 and in_prompt [C, V], "
                         "contiguous")


def penalize_logits(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts_rows: torch.Tensor,
    params: torch.Tensor,
    counts: torch.Tensor | None,
    in_prompt: torch.Tensor | None,
    width: int,
) -> torch.Tensor:
    R, V = rows.shape[0], logits.shape[-1]
    _check_penalize(logits, R, params, counts, in_prompt)
    if width < V:
        raise ValueError(f"penalize_logits needs width >= {V}, got {width}")
    out = torch.empty(R, width, dtype=torch.float32, device=logits.device)
    has_counts = counts is not None
    if R == 0:
        return out
    _penalize_kernel[(R, triton.cdiv(width, _BLOCK))](
        logits, rows, counts_rows, params.contiguous(),
        counts if has_counts else logits,
        in_prompt.view(torch.uint8) if has_counts else logits,
        out, V, width, rows.stride(0), counts_rows.stride(0), logits.stride(0),
        counts.stride(0) if has_counts else 0, out.stride(0),
        HAS_COUNTS=has_counts, BLOCK=_BLOCK,
    )
    return out


@triton.jit
def _drawn(b_x, o_k, K, p_rows, noise, i_r, stride_n):
    """The index of the candidate drawn among a row's largest-first candidate logits b_x [KP]
    (-inf past its top-k): min-p, softmax, top-p, then the argmax of probability over noise."""
    top = tl.max(b_x, 0)  # (the first value: they come largest first)
    b_x = tl.where(b_x < top + tl.load(p_rows + i_r * 6 + 2), float("-inf"), b_x)  # min-p
    b_e = tl.exp(b_x - top)
    b_p = b_e / tl.sum(b_e, 0)
    b_p = tl.where(tl.cumsum(b_p, 0) - b_p >= tl.load(p_rows + i_r * 6 + 1), 0.0, b_p)  # top-p
    b_n = tl.load(noise + i_r * stride_n + o_k, mask=o_k < K, other=1.0)
    return tl.minimum(tl.argmax(b_p / b_n, 0), K - 1)  # (in range even for a NaN row)


@triton.jit
def _draw_kernel(values, cols, noise, top_k, p_rows, out, K, stride_k, stride_v, stride_c,
                 stride_n, KP: tl.constexpr):
    i_r = tl.program_id(0)
    o_k = tl.arange(0, KP)
    k = tl.load(top_k + i_r * stride_k)
    # beyond the row's top-k (and the K columns) a candidate is -inf: probability 0
    b_x = tl.load(values + i_r * stride_v + o_k, mask=(o_k < K) & (o_k < k), other=float("-inf"))
    j = _drawn(b_x, o_k, K, p_rows, noise, i_r, stride_n)
    tl.store(out + i_r, tl.load(cols + i_r * stride_c + j))


def draw_candidates(
    values: torch.Tensor,
    cols: torch.Tensor,
    noise: torch.Tensor,
    top_k: torch.Tensor,
    params: torch.Tensor,
) -> torch.Tensor:
    R, K = values.shape
    if (cols.shape != (R, K) or noise.shape != (R, K) or values.dtype != torch.float32
            or cols.dtype != torch.int64 or noise.dtype != torch.float32
            or min(values.stride(-1), cols.stride(-1), noise.stride(-1)) != 1):
        raise ValueError("draw_candidates needs values and noise [R, K] float32 and cols [R, K] "
                         "int64, each with unit column stride")
    if params.shape != (R, 6) or top_k.shape != (R,):
        raise ValueError(f"draw_candidates needs params [{R}, 6] and top_k [{R}]")
    out = torch.empty(R, dtype=torch.int64, device=values.device)
    if R == 0:
        return out
    _draw_kernel[(R,)](values, cols, noise, top_k, params.contiguous(), out, K, top_k.stride(0),
                       values.stride(0), cols.stride(0), noise.stride(0),
                       KP=max(16, triton.next_power_of_2(K)))
    return out


_CHUNK = 4096  # vocabulary columns per program of sample_top_k's first kernel
MAX_CANDIDATES = 8192  # sample_top_k keeps chunks x K candidates of a row in one program


@triton.jit
def _key(b_x, o_v):
    """int64 keys whose order is that of the values b_x (float32), then of the lowest column
    o_v among equals: the float's bits made order-preserving as a signed int, over 2**31 - 1
    - the column. One max over keys then gives a value and its column together."""
    bits = b_x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - o_v).to(tl.int64)


@triton.jit
def _chunk_top_k_kernel(logits, rows, counts_rows, p_rows, counts, in_prompt, keys, V, K,
                        stride_r, stride_cr, stride_l, stride_c, HAS_COUNTS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """The keys (_key) of the K largest penalised, scaled logits of one row's chunk of BLOCK
    columns, largest first; past the chunk's columns below V, the least int64 (so never one
    of a row's K best: V >= K). Found by float and int32 reductions (a max, then the lowest
    column holding it), which run faster here than one int64 max."""
    i_r, i_v = tl.program_id(0), tl.program_id(1)
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    b_x = _penalized(logits, rows, counts_rows, p_rows, counts, in_prompt, i_r, o_v, V, stride_r,
                     stride_cr, stride_l, stride_c, HAS_COUNTS)
    _store_chunk_keys(b_x, o_v, V, i_v, keys, (i_r * tl.num_programs(1) + i_v).to(tl.int64) * K,
                      K, BLOCK)


@triton.jit
def _store_chunk_keys(b_x, o_v, V, i_v, keys, base, K, BLOCK: tl.constexpr):
    """Store at keys + base the keys (_key) of the K largest of a chunk's values b_x (columns
    o_v of chunk i_v), largest first, each column once (-inf ones too, lowest first); past the
    chunk's columns below V, the least int64 (so never one of a row's K best: V >= K)."""
    least = -0x7FFFFFFFFFFFFFFF - 1
    valid = V - i_v * BLOCK  # (a real column comes before padding: both -inf, it is lower)
    left = o_v < V + BLOCK  # (the columns not taken yet: every one)
    for j in range(K):
        top = tl.max(tl.where(left, b_x, float("-inf")), 0)
        col = tl.min(tl.where(left & (b_x == top), o_v, V + BLOCK), 0)
        key = _key(top, tl.minimum(col, V - 1))  # (a NaN row finds no column: keep it in range)
        tl.store(keys + base + j, tl.where(j < valid, key, least))
        left = left & (o_v != col)


@triton.jit
def _merged_top(keys, i_r, N, K, NP: tl.constexpr, KP: tl.constexpr):
    """Row i_r's K largest keys among its N chunk candidates, largest first, as values
    (float32; -inf past them) and columns (0 past them), [KP] each."""
    least = -0x7FFFFFFFFFFFFFFF - 1
    o_n = tl.arange(0, NP)
    b_c = tl.load(keys + i_r.to(tl.int64) * N + o_n, mask=o_n < N, other=least)
    o_k = tl.arange(0, KP)
    b_top = tl.full([KP], least, tl.int64)
    for j in range(K):
        top = tl.max(b_c, 0)
        b_top = tl.where(o_k == j, top, b_top)
        b_c = tl.where(b_c == top, least, b_c)
    ordered = (b_top >> 32).to(tl.int32)  # (undo _key)
    b_v = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
    b_v = tl.where(b_top == least, float("-inf"), b_v)  # (a slot past the candidates)
    b_t = tl.where(b_top == least, 0, 0x7FFFFFFF - (b_top & 0xFFFFFFFF))  # (token 0 there)
    return b_v, b_t


@triton.jit
def _merge_draw_kernel(keys, noise, top_k, p_rows, out, N, K, stride_k, stride_n,
                       NP: tl.constexpr, KP: tl.constexpr):
    """A row's K likeliest among its N chunk candidates, largest first, then the draw among
    them (_drawn)."""
    i_r = tl.program_id(0)
    o_k = tl.arange(0, KP)
    b_v, b_t = _merged_top(keys, i_r, N, K, NP, KP)
    k = tl.load(top_k + i_r * stride_k)
    b_x = tl.where((o_k < K) & (o_k < k), b_v, float("-inf"))
    j = _drawn(b_x, o_k, K, p_rows, noise, i_r, stride_n)
    tl.store(out + i_r, tl.sum(tl.where(o_k == j, b_t, 0), 0))


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
    """Two kernels: each chunk of _CHUNK columns keeps its K best, then one program per row
    merges them and draws (for K up to MAX_CANDIDATES // chunks: statechat's sampler asks
    for K <= 64; a longer K raises)."""
    R, V = rows.shape[0], logits.shape[-1]
    K = noise.shape[-1]
    chunks = triton.cdiv(V, _CHUNK)
    if not 1 <= K <= V or chunks * K > MAX_CANDIDATES or noise.shape[0] != R or noise.stride(-1) != 1:
        raise ValueError(f"sample_top_k needs noise [{R}, K] with 1 <= K <= "
                         f"{min(V, MAX_CANDIDATES // chunks)} at this vocabulary")
    _check_penalize(logits, R, params, counts, in_prompt)
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    keys = torch.empty(R, chunks * K, dtype=torch.int64, device=logits.device)
    has_counts = counts is not None
    _chunk_top_k_kernel[(R, chunks)](
        logits, rows, counts_rows, params.contiguous(),
        counts if has_counts else logits, in_prompt.view(torch.uint8) if has_counts else logits,
        keys, V, K, rows.stride(0), counts_rows.stride(0), logits.stride(0),
        counts.stride(0) if has_counts else 0, HAS_COUNTS=has_counts, BLOCK=_CHUNK, num_warps=8,
    )
    _merge_draw_kernel[(R,)](
        keys, noise, top_k, params.contiguous(), out, chunks * K, K, top_k.stride(0),
        noise.stride(0), NP=triton.next_power_of_2(chunks * K),
        KP=max(16, triton.next_power_of_2(K)), num_warps=8,
    )
    return out


@triton.jit
def _score_chunk_kernel(logits, targets, stats, keys, V, K, stride_l, BLOCK: tl.constexpr):
    """Of one row's chunk of BLOCK logits: the max, the sum of exp(logit - max), how many
    exceed the row's target token's logit (stats [R, chunks, 3]), and the keys of the K
    largest (_store_chunk_keys)."""
    i_r, i_v = tl.program_id(0), tl.program_id(1)
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    row = logits + i_r.to(tl.int64) * stride_l
    b_x = tl.load(row + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
    target = tl.load(row + tl.load(targets + i_r)).to(tl.float32)
    top = tl.max(b_x, 0)
    total = tl.where(top == float("-inf"), 0.0, tl.sum(tl.exp(b_x - top), 0))
    above = tl.sum((b_x > target).to(tl.float32), 0)
    chunk = (i_r * tl.num_programs(1) + i_v).to(tl.int64)
    tl.store(stats + chunk * 3, top)
    tl.store(stats + chunk * 3 + 1, total)
    tl.store(stats + chunk * 3 + 2, above)
    _store_chunk_keys(b_x, o_v, V, i_v, keys, chunk * K, K, BLOCK)


@triton.jit
def _score_merge_kernel(logits, targets, stats, keys, out, C, N, K, stride_l, stride_o,
                        CP: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr):
    """A row's log-sum-exp from its C chunks' stats, then its table row: the target's
    log-probability, the K largest and their columns (_merged_top), the target's rank."""
    i_r = tl.program_id(0)
    o_c = tl.arange(0, CP)
    b_st = stats + i_r.to(tl.int64) * C * 3 + o_c * 3
    b_m = tl.load(b_st, mask=o_c < C, other=float("-inf"))
    top = tl.max(b_m, 0)
    b_s = tl.load(b_st + 1, mask=o_c < C, other=0.0)
    lse = top + tl.log(tl.sum(tl.where(b_m == float("-inf"), 0.0, b_s * tl.exp(b_m - top)), 0))
    rank = tl.sum(tl.load(b_st + 2, mask=o_c < C, other=0.0), 0) + 1
    target = tl.load(logits + i_r.to(tl.int64) * stride_l + tl.load(targets + i_r)).to(tl.float32)
    b_v, b_t = _merged_top(keys, i_r, N, K, NP, KP)
    o_k = tl.arange(0, KP)
    o = out + i_r.to(tl.int64) * stride_o
    tl.store(o, tl.maximum(target - lse, -9999.0))
    tl.store(o + 1 + o_k, tl.maximum(b_v - lse, -9999.0), mask=o_k < K)
    tl.store(o + 1 + K + o_k, b_t.to(tl.float32), mask=o_k < K)
    tl.store(o + 1 + 2 * K, rank)


def score_logits(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Two kernels: each chunk of _CHUNK columns of a row reduces its logits (max, sum of
    exponentials, count above the target) and keeps its k best; one program per row merges
    them into the table row. The logits are read once, in their own dtype."""
    R, V = logits.shape
    chunks = triton.cdiv(V, _CHUNK)
    if logits.stride(-1) != 1 or targets.shape != (R,) or targets.dtype != torch.int64:
        raise ValueError("score_logits needs logits [R, V] with unit column stride and targets "
                         "[R] int64")
    if not 0 <= k <= V or chunks * k > MAX_CANDIDATES:
        raise ValueError(f"score_logits needs 0 <= k <= {min(V, MAX_CANDIDATES // chunks)} at "
                         "this vocabulary")
    out = torch.empty(R, 2 + 2 * k, dtype=torch.float32, device=logits.device)
    if R == 0:
        return out
    stats = torch.empty(R, chunks, 3, dtype=torch.float32, device=logits.device)
    keys = torch.empty(R, max(chunks * k, 1), dtype=torch.int64, device=logits.device)
    _score_chunk_kernel[(R, chunks)](logits, targets, stats, keys, V, k, logits.stride(0),
                                     BLOCK=_CHUNK, num_warps=8)
    _score_merge_kernel[(R,)](
        logits, targets, stats, keys, out, chunks, chunks * k, k, logits.stride(0), out.stride(0),
        CP=max(16, triton.next_power_of_2(chunks)), NP=max(16, triton.next_power_of_2(chunks * k)),
        KP=max(16, triton.next_power_of_2(k)), num_warps=8,
    )
    return out
