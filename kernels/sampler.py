"""The sampler's work in a few kernels, where torch launches one kernel per op.

- `penalize_logits`: the rows' logits under their penalties and temperature, padded with -inf
  (one pass over the vocabulary; torch's ops take five to eight, each a launch).
- `draw_candidates`: a row's draw among its top-k candidates (top-k, min-p, softmax, top-p and
  the exponential race) in one kernel; torch's ops take about a dozen small launches.
- `sample_top_k`: both, from the logits on, for a top-k of at most 64 (two kernels).
- `sample_vocabulary`: a draw over the whole vocabulary under min-p and top-p, without the
  sort torch's ops need for top-p (four kernels; an exact search when the race's first 16
  draws are all dropped).
- `score_logits`: prompt logprobs and the logprob table: each row's log-probability of a
  given token, its rank and the k likeliest, in one read of the logits (torch's log-softmax,
  top-k and comparison read and write a float32 copy of them several times).

A kernel's work items are its rows, or its rows' vocabulary chunks. Each kernel has two forms
from one source (its `LOOP` constexpr, kernels.hw.persistent_grid): one program per item (CUDA;
rows x chunks on two grid axes, `_chunk_grid`), or a persistent grid of one axis where program
p takes items p, p + P, p + 2P, ... (elsewhere; item r * chunks + c, a row's chunks adjacent);
an item's math (a `_..._item` or `_..._row` helper) does not depend on the program that runs
it. The exact search's loops have fixed trip counts (_threshold).

The top-k of a top-k above 64 stays torch's (statechat.engine.sampling.top_k): a selection
is where torch is already good. Contracts and shapes: kernels/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import cuda_hints, launch, persistent_grid

_BLOCK = 2048  # vocabulary columns per work item of penalize_logits
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
def _penalize_item(logits, rows, counts_rows, p_rows, counts, in_prompt, out, V, W, stride_r,
                   stride_cr, stride_l, stride_c, stride_o, C, i_r, i_v, HAS_COUNTS: tl.constexpr,
                   BLOCK: tl.constexpr):
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    b_x = _penalized(logits, rows, counts_rows, p_rows, counts, in_prompt, i_r, o_v, V,
                     stride_r, stride_cr, stride_l, stride_c, HAS_COUNTS)
    tl.store(out + tl.cast(i_r, tl.int64) * stride_o + o_v, b_x, mask=o_v < W)


@triton.jit(do_not_specialize=["NUM_ITEMS", "NUM_PROGS"])
def _penalize_kernel(logits, rows, counts_rows, p_rows, counts, in_prompt, out, V, W,
                     stride_r, stride_cr, stride_l, stride_c, stride_o, C, NUM_ITEMS, NUM_PROGS,
                     PID0, LOOP: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
            _penalize_item(logits, rows, counts_rows, p_rows, counts, in_prompt, out, V, W,
                           stride_r, stride_cr, stride_l, stride_c, stride_o, C, i_item // C,
                           i_item % C, HAS_COUNTS, BLOCK)
    else:  # one program per item, on a grid of rows x chunks
        _penalize_item(logits, rows, counts_rows, p_rows, counts, in_prompt, out, V, W,
                       stride_r, stride_cr, stride_l, stride_c, stride_o, C,
                       tl.program_id(0) + PID0, tl.program_id(1), HAS_COUNTS, BLOCK)


def _chunk_grid(R: int, chunks: int, device: torch.device) -> tuple[tuple[int, ...], int, bool]:
    """(grid, programs, loop) of a kernel over R rows x `chunks` vocabulary chunks: looping, one
    axis of hw.persistent_grid's programs; else a grid of rows x chunks, one program per item
    (on one axis of R * chunks, the H100 kept 12-16 more registers a thread live in the chunk
    kernels' top-K loop, so fewer ran at once: 15-27% slower)."""
    programs, loop = persistent_grid(R * chunks, device)
    return ((programs,) if loop else (R, chunks)), programs, loop


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
    chunks = triton.cdiv(width, _BLOCK)
    grid, programs, loop = _chunk_grid(R, chunks, logits.device)
    launch(
        _penalize_kernel, grid,
        logits, rows, counts_rows, params.contiguous(),
        counts if has_counts else logits,
        in_prompt.view(torch.uint8) if has_counts else logits,
        out, V, width, rows.stride(0), counts_rows.stride(0), logits.stride(0),
        counts.stride(0) if has_counts else 0, out.stride(0), chunks, R * chunks, programs,
        LOOP=loop, HAS_COUNTS=has_counts, BLOCK=_BLOCK,
    )
    return out


@triton.jit
def _rank_key(b_x, b_t, o_k):
    """The keys [KP] (int64) whose order hands out a row's noise columns: a candidate of a
    finite logit b_x (within its top-k) by its token id b_t, the others (-inf: probability 0)
    after them by place o_k, so that which ids fill a row short of finite logits moves no
    draw (reference.candidate_ranks)."""
    return tl.where(b_x > float("-inf"), b_t.to(tl.int64), o_k.to(tl.int64) + 0x4000000000000000)


@triton.jit
def _drawn(b_x, b_rank, K, p_rows, noise, i_r, stride_n):
    """The index of the candidate drawn among a row's largest-first candidate logits b_x [KP]
    (-inf past its top-k): min-p, softmax, top-p, then the argmax of probability over noise,
    candidate i taking noise column b_rank[i] (its rank by _rank_key; K or more: none)."""
    top = tl.max(b_x, 0)  # (the first value: they come largest first)
    b_x = tl.where(b_x < top + tl.load(p_rows + i_r * 6 + 2), float("-inf"), b_x)  # min-p
    b_e = tl.exp(b_x - top)
    b_p = b_e / tl.sum(b_e, 0)
    b_p = tl.where(tl.cumsum(b_p, 0) - b_p >= tl.load(p_rows + i_r * 6 + 1), 0.0, b_p)  # top-p
    b_n = tl.load(noise + i_r * stride_n + b_rank, mask=b_rank < K, other=1.0)
    return tl.minimum(tl.argmax(b_p / b_n, 0), K - 1)  # (in range even for a NaN row)


@triton.jit
def _draw_row(values, cols, noise, top_k, p_rows, out, K, stride_k, stride_v, stride_c,
              stride_n, i_r, KP: tl.constexpr, JB: tl.constexpr):
    o_k = tl.arange(0, KP)
    k = tl.load(top_k + i_r * stride_k)
    # beyond the row's top-k (and the K columns) a candidate is -inf: probability 0
    b_x = tl.load(values + i_r * stride_v + o_k, mask=(o_k < K) & (o_k < k),
                  other=float("-inf"))
    b_key = _rank_key(b_x, tl.load(cols + i_r * stride_c + o_k, mask=o_k < K, other=0), o_k)
    # each candidate's rank: the keys below its own, JB at a time (a K x K tile of a K of
    # 1024 takes minutes to compile and spills)
    b_rank = tl.zeros([KP], tl.int32)
    for start in range(0, K, JB):
        o_j = start + tl.arange(0, JB)
        c_x = tl.load(values + i_r * stride_v + o_j, mask=(o_j < K) & (o_j < k),
                      other=float("-inf"))
        c_key = _rank_key(c_x, tl.load(cols + i_r * stride_c + o_j, mask=o_j < K, other=0),
                          o_j)
        below = (c_key[None, :] < b_key[:, None]) & (o_j < K)[None, :]
        b_rank += tl.sum(below.to(tl.int32), 1)
    j = _drawn(b_x, b_rank, K, p_rows, noise, i_r, stride_n)
    tl.store(out + i_r, tl.load(cols + i_r * stride_c + j))


@triton.jit(do_not_specialize=["R", "NUM_PROGS"])
def _draw_kernel(values, cols, noise, top_k, p_rows, out, K, stride_k, stride_v, stride_c,
                 stride_n, R, NUM_PROGS, PID0, LOOP: tl.constexpr, KP: tl.constexpr,
                 JB: tl.constexpr):
    if LOOP:
        for i_r in range(tl.program_id(0) + PID0, R, NUM_PROGS):
            _draw_row(values, cols, noise, top_k, p_rows, out, K, stride_k, stride_v, stride_c,
                      stride_n, i_r, KP, JB)
    else:  # one program per row
        _draw_row(values, cols, noise, top_k, p_rows, out, K, stride_k, stride_v, stride_c,
                  stride_n, tl.program_id(0) + PID0, KP, JB)


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
    grid, loop = persistent_grid(R, values.device)
    launch(_draw_kernel, (grid,), values, cols, noise, top_k, params.contiguous(), out, K,
           top_k.stride(0), values.stride(0), cols.stride(0), noise.stride(0), R, grid,
           LOOP=loop, KP=max(16, triton.next_power_of_2(K)), JB=16)
    return out


_CHUNK = 4096  # vocabulary columns per work item of sample_top_k's first kernel
MAX_CANDIDATES = 8192  # sample_top_k keeps chunks x K candidates of a row in one merge
_ONE_BUILD = 32  # every K up to this shares one build of a merge kernel (see _merge_sizes)


def _merge_sizes(chunks: int, k: int) -> tuple[int, int]:
    """(NP, KP): a merge kernel's tile of the chunks' k candidates each, and of the k best.
    Sized for at least _ONE_BUILD candidates a chunk (within MAX_CANDIDATES), and with k and
    the candidates' count not specialised on, every k up to it runs one compiled kernel:
    Triton compiles on a kernel's first call, stalling the step (and every request in it)."""
    kp = max(_ONE_BUILD, triton.next_power_of_2(k))
    least = min(triton.next_power_of_2(chunks * kp), MAX_CANDIDATES)
    return max(16, triton.next_power_of_2(chunks * k), least), kp


@triton.jit
def _key(b_x, o_v):
    """int64 keys whose order is that of the values b_x (float32), then of the lowest column
    o_v among equals: the float's bits made order-preserving as a signed int, over 2**31 - 1
    - the column. One max over keys then gives a value and its column together."""
    return (_ordered(b_x).to(tl.int64) << 32) | (0x7FFFFFFF - o_v).to(tl.int64)


@triton.jit
def _ordered(b_x):
    """float32 values as int32 of the same order: their bits, the negative ones' flipped."""
    bits = b_x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _value(ordered):
    """The float32 value of an int32 from _ordered."""
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_top_k_item(logits, rows, counts_rows, p_rows, counts, in_prompt, keys, V, K,
                      stride_r, stride_cr, stride_l, stride_c, C, i_r, i_v,
                      HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    b_x = _penalized(logits, rows, counts_rows, p_rows, counts, in_prompt, i_r, o_v, V,
                     stride_r, stride_cr, stride_l, stride_c, HAS_COUNTS)
    _store_chunk_keys(b_x, V, i_v, keys, tl.cast(i_r * C + i_v, tl.int64) * K, K, BLOCK)


@triton.jit(do_not_specialize=["K", "NUM_ITEMS", "NUM_PROGS"])
def _chunk_top_k_kernel(logits, rows, counts_rows, p_rows, counts, in_prompt, keys, V, K,
                        stride_r, stride_cr, stride_l, stride_c, C, NUM_ITEMS, NUM_PROGS, PID0,
                        LOOP: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    """The keys (_key) of the K largest penalised, scaled logits of one row's chunk of BLOCK
    columns, largest first; past the chunk's columns below V, the least int64 (so never one
    of a row's K best: V >= K). Found by float and int32 reductions (a max, then the lowest
    column holding it), which run faster here than one int64 max."""
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
            _chunk_top_k_item(logits, rows, counts_rows, p_rows, counts, in_prompt, keys, V, K,
                              stride_r, stride_cr, stride_l, stride_c, C, i_item // C,
                              i_item % C, HAS_COUNTS, BLOCK)
    else:  # one program per item, on a grid of rows x chunks
        _chunk_top_k_item(logits, rows, counts_rows, p_rows, counts, in_prompt, keys, V, K,
                          stride_r, stride_cr, stride_l, stride_c, C, tl.program_id(0) + PID0,
                          tl.program_id(1), HAS_COUNTS, BLOCK)


@triton.jit
def _store_chunk_keys(b_x, V, i_v, keys, base, K, BLOCK: tl.constexpr):
    """Store at keys + base the keys (_key) of the K largest of a chunk's values b_x (the
    BLOCK columns of chunk i_v), largest first, each column once (-inf ones too, lowest
    first); past the chunk's columns below V, the least int64 (so never one of a row's K best:
    V >= K)."""
    least = -0x7FFFFFFFFFFFFFFF - 1
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    valid = V - i_v * BLOCK  # (a real column comes before padding: both -inf, it is lower)
    left = o_v < V + BLOCK  # (the columns not taken yet: every one)
    for j in range(K):
        top = tl.max(tl.where(left, b_x, float("-inf")), 0)
        col = tl.min(tl.where(left & (b_x == top), o_v, V + BLOCK), 0)
        key = _key(top, tl.minimum(col, V - 1))  # (a NaN row finds no column: keep it in range)
        tl.store(keys + base + j, tl.where(j < valid, key, least))
        left = left & (o_v != col)


@triton.jit
def _merged_keys(keys, i_r, N, K, NP: tl.constexpr, KP: tl.constexpr):
    """Row i_r's K largest keys among its N chunk candidates, largest first ([KP] int64; the
    least int64 past them)."""
    least = -0x7FFFFFFFFFFFFFFF - 1
    o_n = tl.arange(0, NP)
    b_c = tl.load(keys + tl.cast(i_r, tl.int64) * N + o_n, mask=o_n < N, other=least)
    o_k = tl.arange(0, KP)
    b_top = tl.full([KP], least, tl.int64)
    for j in range(K):
        top = tl.max(b_c, 0)
        b_top = tl.where(o_k == j, top, b_top)
        b_c = tl.where(b_c == top, least, b_c)
    return b_top


@triton.jit
def _merged_top(keys, i_r, N, K, NP: tl.constexpr, KP: tl.constexpr):
    """Row i_r's K largest keys among its N chunk candidates, largest first, as values
    (float32; -inf past them) and columns (0 past them), [KP] each."""
    least = -0x7FFFFFFFFFFFFFFF - 1
    b_top = _merged_keys(keys, i_r, N, K, NP, KP)
    b_v = _value((b_top >> 32).to(tl.int32))  # (undo _key)
    b_v = tl.where(b_top == least, float("-inf"), b_v)  # (a slot past the candidates)
    b_t = tl.where(b_top == least, 0, 0x7FFFFFFF - (b_top & 0xFFFFFFFF))  # (token 0 there)
    return b_v, b_t


@triton.jit
def _merge_draw_row(keys, noise, top_k, p_rows, out, N, K, stride_k, stride_n, i_r,
                    NP: tl.constexpr, KP: tl.constexpr):
    o_k = tl.arange(0, KP)
    b_v, b_t = _merged_top(keys, i_r, N, K, NP, KP)
    k = tl.load(top_k + i_r * stride_k)
    b_x = tl.where((o_k < K) & (o_k < k), b_v, float("-inf"))
    b_key = _rank_key(b_x, b_t, o_k)  # (a K x K tile: K is at most 64 in the engine)
    b_rank = tl.sum((b_key[None, :] < b_key[:, None]).to(tl.int32), 1)
    j = _drawn(b_x, b_rank, K, p_rows, noise, i_r, stride_n)
    tl.store(out + i_r, tl.sum(tl.where(o_k == j, b_t, 0), 0))


@triton.jit(do_not_specialize=["N", "K", "R", "NUM_PROGS"])
def _merge_draw_kernel(keys, noise, top_k, p_rows, out, N, K, stride_k, stride_n, R, NUM_PROGS,
                       PID0, LOOP: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr):
    """A row's K likeliest among its N chunk candidates, largest first, then the draw among
    them (_drawn)."""
    if LOOP:
        for i_r in range(tl.program_id(0) + PID0, R, NUM_PROGS):
            _merge_draw_row(keys, noise, top_k, p_rows, out, N, K, stride_k, stride_n, i_r, NP,
                            KP)
    else:  # one program per row
        _merge_draw_row(keys, noise, top_k, p_rows, out, N, K, stride_k, stride_n,
                        tl.program_id(0) + PID0, NP, KP)


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
    """Two kernels: each chunk of _CHUNK columns keeps its K best, then each row's work merges
    them and draws (for K up to MAX_CANDIDATES // chunks: statechat's sampler asks
    for K <= 64; a longer K raises)."""
    R, V = rows.shape[0], logits.shape[-1]
    K = noise.shape[-1]
    chunks = triton.cdiv(V, _CHUNK)
    if (not 1 <= K <= V or chunks * K > MAX_CANDIDATES or noise.shape[0] != R
            or noise.stride(-1) != 1):
        raise ValueError(f"sample_top_k needs noise [{R}, K] with 1 <= K <= "
                         f"{min(V, MAX_CANDIDATES // chunks)} at this vocabulary")
    _check_penalize(logits, R, params, counts, in_prompt)
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    keys = torch.empty(R, chunks * K, dtype=torch.int64, device=logits.device)
    has_counts = counts is not None
    grid, programs, loop = _chunk_grid(R, chunks, logits.device)
    launch(
        _chunk_top_k_kernel, grid,
        logits, rows, counts_rows, params.contiguous(),
        counts if has_counts else logits, in_prompt.view(torch.uint8) if has_counts else logits,
        keys, V, K, rows.stride(0), counts_rows.stride(0), logits.stride(0),
        counts.stride(0) if has_counts else 0, chunks, R * chunks, programs, LOOP=loop,
        HAS_COUNTS=has_counts, BLOCK=_CHUNK, **cuda_hints(logits.device, num_warps=8),
    )
    np_, kp = _merge_sizes(chunks, K)
    grid, loop = persistent_grid(R, logits.device)
    launch(
        _merge_draw_kernel, (grid,),
        keys, noise, top_k, params.contiguous(), out, chunks * K, K, top_k.stride(0),
        noise.stride(0), R, grid, LOOP=loop, NP=np_, KP=kp,
        **cuda_hints(logits.device, num_warps=8),
    )
    return out


_RACE = 8  # race candidates each chunk keeps in sample_vocabulary
_TESTED = 16  # of which a row's best are tested against its min-p and top-p
_SUB = 512  # columns per step of sample_vocabulary's mass kernel
_CAP = 4096  # its exact search ends in registers once this few tokens are left in its range,
_HALVINGS = 12  # after at most this many passes halving that range (else it bisects keys)


@triton.jit
def _race_chunk_item(logits, rows, counts_rows, p_rows, counts, in_prompt, noise, xs, maxes,
                     keys, V, stride_r, stride_cr, stride_l, stride_c, stride_n, C, i_r, i_v,
                     HAS_COUNTS: tl.constexpr, RACE: tl.constexpr, BLOCK: tl.constexpr):
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    b_x = _penalized(logits, rows, counts_rows, p_rows, counts, in_prompt, i_r, o_v, V,
                     stride_r, stride_cr, stride_l, stride_c, HAS_COUNTS)
    tl.store(xs + tl.cast(i_r, tl.int64) * V + o_v, b_x, mask=o_v < V)
    chunk = tl.cast(i_r * C + i_v, tl.int64)
    tl.store(maxes + chunk, tl.max(b_x, 0))
    b_n = tl.load(noise + tl.cast(i_r, tl.int64) * stride_n + o_v, mask=o_v < V, other=1.0)
    _store_chunk_keys(b_x - tl.log(b_n), V, i_v, keys, chunk * RACE, RACE, BLOCK)


@triton.jit(do_not_specialize=["NUM_ITEMS", "NUM_PROGS"])
def _race_chunk_kernel(logits, rows, counts_rows, p_rows, counts, in_prompt, noise, xs, maxes,
                       keys, V, stride_r, stride_cr, stride_l, stride_c, stride_n, C, NUM_ITEMS,
                       NUM_PROGS, PID0, LOOP: tl.constexpr, HAS_COUNTS: tl.constexpr,
                       RACE: tl.constexpr, BLOCK: tl.constexpr):
    """One row's chunk of BLOCK columns: its penalised, scaled logits x (into xs [R, V]), their
    max, and the keys (_key) of its RACE largest race values x - log(noise). Over any set of
    tokens, the one of largest race value is a draw from their probabilities (the exponential
    race)."""
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
            _race_chunk_item(logits, rows, counts_rows, p_rows, counts, in_prompt, noise, xs,
                             maxes, keys, V, stride_r, stride_cr, stride_l, stride_c, stride_n,
                             C, i_item // C, i_item % C, HAS_COUNTS, RACE, BLOCK)
    else:  # one program per item, on a grid of rows x chunks
        _race_chunk_item(logits, rows, counts_rows, p_rows, counts, in_prompt, noise, xs, maxes,
                         keys, V, stride_r, stride_cr, stride_l, stride_c, stride_n, C,
                         tl.program_id(0) + PID0, tl.program_id(1), HAS_COUNTS, RACE, BLOCK)


@triton.jit
def _race_merge_row(maxes, keys, xs, tops, tested_x, tested_col, C, N, V, i_r,
                    RACE: tl.constexpr, K: tl.constexpr, CP: tl.constexpr, NP: tl.constexpr):
    least = -0x7FFFFFFFFFFFFFFF - 1
    o_c = tl.arange(0, CP)
    top = tl.max(tl.load(maxes + tl.cast(i_r, tl.int64) * C + o_c, mask=o_c < C,
                         other=float("-inf")), 0)
    tl.store(tops + i_r, top)
    bound = tl.max(tl.load(keys + tl.cast(i_r, tl.int64) * N + o_c * RACE + RACE - 1,
                           mask=o_c < C, other=least), 0)
    b_top = _merged_keys(keys, i_r, N, K, NP, K)
    b_col = tl.where(b_top != least, 0x7FFFFFFF - (b_top & 0xFFFFFFFF), 0)
    o_k = tl.arange(0, K)
    tl.store(tested_x + i_r * K + o_k, tl.load(xs + tl.cast(i_r, tl.int64) * V + b_col))
    certain = (b_top >= bound) & (b_top != least)
    tl.store(tested_col + i_r * K + o_k, tl.where(certain, b_col, -1).to(tl.int32))


@triton.jit(do_not_specialize=["R", "NUM_PROGS"])
def _race_merge_kernel(maxes, keys, xs, tops, tested_x, tested_col, C, N, V, R, NUM_PROGS,
                       PID0, LOOP: tl.constexpr, RACE: tl.constexpr, K: tl.constexpr,
                       CP: tl.constexpr, NP: tl.constexpr):
    """A row's largest x (over its C chunks' maxima) and its K largest race values among the N
    its chunks kept, largest first: each one's x and column (tested_x, tested_col [R, K]). A
    column is -1 where the race value is not certainly the row's next: below some chunk's
    last kept one (that chunk's next, which it did not keep, may lie above), or none (its x
    is then column 0's)."""
    if LOOP:
        for i_r in range(tl.program_id(0) + PID0, R, NUM_PROGS):
            _race_merge_row(maxes, keys, xs, tops, tested_x, tested_col, C, N, V, i_r, RACE, K,
                            CP, NP)
    else:  # one program per row
        _race_merge_row(maxes, keys, xs, tops, tested_x, tested_col, C, N, V,
                        tl.program_id(0) + PID0, RACE, K, CP, NP)


@triton.jit
def _race_mass_item(xs, tops, tested_x, tested_col, p_rows, sums, V, C, i_r, i_v,
                    K: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    top = tl.load(tops + i_r)
    floor = top + tl.load(p_rows + i_r * 6 + 2)
    o_k = tl.arange(0, K)
    c_x = tl.load(tested_x + i_r * K + o_k)
    c_col = tl.load(tested_col + i_r * K + o_k)
    total = tl.zeros([SUB], tl.float32)
    before = tl.zeros([K], tl.float32)
    for start in range(0, BLOCK, SUB):
        o_v = i_v * BLOCK + start + tl.arange(0, SUB)
        b_x = tl.load(xs + tl.cast(i_r, tl.int64) * V + o_v, mask=o_v < V,
                      other=float("-inf"))
        b_e = tl.where(b_x >= floor, tl.exp(b_x - top), 0.0)
        total += b_e
        ahead = (b_x[:, None] > c_x[None, :]) | ((b_x[:, None] == c_x[None, :])
                                                  & (o_v[:, None] < c_col[None, :]))
        before += tl.sum(tl.where(ahead, b_e[:, None], 0.0), 0)
    out = sums + tl.cast(i_r * C + i_v, tl.int64) * (1 + K)
    tl.store(out, tl.sum(total, 0))
    tl.store(out + 1 + o_k, before)


@triton.jit(do_not_specialize=["NUM_ITEMS", "NUM_PROGS"])
def _race_mass_kernel(xs, tops, tested_x, tested_col, p_rows, sums, V, C, NUM_ITEMS, NUM_PROGS,
                      PID0, LOOP: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
                      SUB: tl.constexpr):
    """Of one row's chunk of BLOCK columns, over its min-p survivors (x >= the row's largest +
    log min-p): the sum of exp(x - largest), and for each tested token that sum over the
    tokens a stable descending sort puts before it (a larger x, or an equal x at a lower
    column). sums [R, C, 1 + K]."""
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
            _race_mass_item(xs, tops, tested_x, tested_col, p_rows, sums, V, C, i_item // C,
                            i_item % C, K, BLOCK, SUB)
    else:  # one program per item, on a grid of rows x chunks
        _race_mass_item(xs, tops, tested_x, tested_col, p_rows, sums, V, C,
                        tl.program_id(0) + PID0, tl.program_id(1), K, BLOCK, SUB)


@triton.jit
def _search_pass(row, lo, mid, hi, V, BLOCK: tl.constexpr):
    """One pass over a row of e = exp(x - top) (0 past the survivors; as int32 bits, in the
    order of the values): the sum of e over the keys at or above `mid`; how many keys lie in
    [lo, mid) and in [mid, hi] (lo >= 1: padding, at 0, is in neither); the largest key in
    [lo, mid), and the least and largest in [mid, hi] (lo - 1, hi + 1, lo - 1 if none)."""
    mass = tl.zeros([BLOCK], tl.float32)
    low = tl.zeros([BLOCK], tl.int32)
    high = tl.zeros([BLOCK], tl.int32)
    low_top = tl.full([BLOCK], lo - 1, tl.int32)
    high_least = tl.full([BLOCK], hi + 1, tl.int32)
    high_top = tl.full([BLOCK], lo - 1, tl.int32)
    for start in range(0, V, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        b_e = tl.load(row + o_v, mask=o_v < V, other=0.0)
        b_k = b_e.to(tl.int32, bitcast=True)
        mass += tl.where(b_k >= mid, b_e, 0.0)
        in_low = (b_k >= lo) & (b_k < mid)
        in_high = (b_k >= mid) & (b_k <= hi)
        low += in_low.to(tl.int32)
        high += in_high.to(tl.int32)
        low_top = tl.maximum(low_top, tl.where(in_low, b_k, lo - 1))
        high_least = tl.minimum(high_least, tl.where(in_high, b_k, hi + 1))
        high_top = tl.maximum(high_top, tl.where(in_high, b_k, lo - 1))
    return (tl.sum(mass, 0), tl.sum(low, 0), tl.sum(high, 0), tl.max(low_top, 0),
            tl.min(high_least, 0), tl.max(high_top, 0))


# Trips of the exact search's bisections (for loops of a fixed count, in place of `while lo <
# hi`: Ascend's guides advise against loops on loaded values). A trip keeps [mid, hi] or [lo,
# mid - 1] of a range of n = hi - lo + 1 int32 keys, mid = lo + n // 2: ceil(n / 2) or n // 2
# keys, so after t trips at most ceil(n / 2**t) are left. The range starts with lo >= 1 and
# hi <= 2**31 - 1, so n < 2**31 and 31 trips leave one key (lo == hi: where the while loop
# stopped; the trips after that are masked and change nothing).
_BISECTIONS = tl.constexpr(31)


@triton.jit
def _threshold(row, scratch, lo, hi, target, V, BLOCK: tl.constexpr, CAP: tl.constexpr,
               HALVINGS: tl.constexpr):
    """The key of the least kept e (the largest t whose e at or above it reach `target`),
    between keys lo and hi, from a row of e (_search_pass): the range halved pass by pass (in
    value, or in key where it spans binades; then to the keys it holds) while more than CAP
    keys lie in it, then those gathered into `scratch` and searched there (else, after
    HALVINGS passes, the keys bisected pass by pass).

    Every loop has a fixed trip count; a trip after the search's end changes nothing (its
    updates are masked) and loads nothing (its pass runs over no columns)."""
    count = V
    for _ in range(HALVINGS):
        go = (lo < hi) & (count > CAP)
        low_e, high_e = lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
        half = ((low_e + high_e) * 0.5).to(tl.int32, bitcast=True)
        half = tl.where(high_e > 4 * low_e, lo + (hi - lo + 1) // 2, half)  # (across binades:
        mid = tl.minimum(tl.maximum(half, lo + 1), hi)  # the keys' middle, a geometric one)
        mass, low, high, low_top, high_least, high_top = _search_pass(
            row, lo, mid, hi, tl.where(go, V, 0), BLOCK)
        reach = mass >= target
        # (the range shrinks to the keys it holds: equal keys end the search at once)
        lo_next = tl.where(reach, tl.where(high > 0, high_least, mid), lo)
        hi_next = tl.where(reach, tl.where(high > 0, high_top, hi),
                           tl.where(low > 0, low_top, mid - 1))
        count = tl.where(go, tl.where(reach, high, low), count)
        lo, hi = tl.where(go, lo_next, lo), tl.where(go, hi_next, hi)
    if lo < hi:
        if count <= CAP:
            above = tl.zeros([BLOCK], tl.float32)
            taken = 0
            for start in range(0, V, BLOCK):
                o_v = start + tl.arange(0, BLOCK)
                b_e = tl.load(row + o_v, mask=o_v < V, other=0.0)
                b_k = b_e.to(tl.int32, bitcast=True)
                inside = (b_k >= lo) & (b_k <= hi)
                at = taken + tl.cumsum(inside.to(tl.int32), 0) - 1
                tl.store(scratch + at, b_e, mask=inside)
                above += tl.where(b_k > hi, b_e, 0.0)
                taken += tl.sum(inside.to(tl.int32), 0)
            tl.debug_barrier()  # (the gathered values, stored by every thread, read by every one)
            above_hi = tl.sum(above, 0)
            o_c = tl.arange(0, CAP)
            c_e = tl.load(scratch + o_c, mask=o_c < taken, other=0.0)
            c_k = c_e.to(tl.int32, bitcast=True)
            for _ in range(_BISECTIONS):  # (no loads: the gathered keys are in registers)
                go = lo < hi
                mid = lo + (hi - lo + 1) // 2
                reach = above_hi + tl.sum(tl.where(c_k >= mid, c_e, 0.0), 0) >= target
                lo, hi = tl.where(go & reach, mid, lo), tl.where(go & ~reach, mid - 1, hi)
        else:
            for _ in range(_BISECTIONS):
                go = lo < hi
                mid = lo + (hi - lo + 1) // 2
                reach = _search_pass(row, mid, mid, mid, tl.where(go, V, 0), BLOCK)[0] >= target
                lo, hi = tl.where(go & reach, mid, lo), tl.where(go & ~reach, mid - 1, hi)
    return lo


@triton.jit
def _exact_draw(row, noise_row, scratch, top, floor, target, lo_e, hi_e, V, BLOCK: tl.constexpr,
                CAP: tl.constexpr, HALVINGS: tl.constexpr):
    """A row's draw when none of its tested tokens is certainly kept. Its x become e = exp(x -
    top) in place (0 below min-p's floor); the least kept e is found (_threshold) between
    lo_e and hi_e (bounds the tested tokens gave: e at or above lo_e reach top-p's `target`,
    hi_e's is kept), equal e kept in column order while the mass before them stays below
    `target` (the stable sort's order); then the largest e / noise among the kept tokens."""
    for start in range(0, V, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        b_x = tl.load(row + o_v, mask=o_v < V, other=float("-inf"))
        tl.store(row + o_v, tl.where(b_x >= floor, tl.exp(b_x - top), 0.0), mask=o_v < V)
    tl.debug_barrier()
    lo = tl.maximum(lo_e.to(tl.int32, bitcast=True), 1)  # (the least kept e is above 0)
    if target < float("inf"):
        lo = _threshold(row, scratch, lo, tl.maximum(hi_e.to(tl.int32, bitcast=True), lo), target,
                        V, BLOCK, CAP, HALVINGS)
    else:
        lo = 1  # (top-p off: every survivor is kept)
    above = _search_pass(row, lo + 1, lo + 1, lo + 1, V, BLOCK)[0]
    each = lo.to(tl.float32, bitcast=True)
    best = tl.full([BLOCK], -0x7FFFFFFFFFFFFFFF - 1, tl.int64)
    ties = 0
    for start in range(0, V, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        b_e = tl.load(row + o_v, mask=o_v < V, other=0.0)
        b_k = b_e.to(tl.int32, bitcast=True)
        tie = b_k == lo
        rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        kept = (b_k > lo) | (tie & (above + rank.to(tl.float32) * each < target))
        b_n = tl.load(noise_row + o_v, mask=o_v < V, other=1.0)
        best = tl.maximum(best, tl.where(kept & (o_v < V), _key(b_e / b_n, o_v), best))
        ties += tl.sum(tie.to(tl.int32), 0)
    return 0x7FFFFFFF - (tl.max(best, 0) & 0xFFFFFFFF)


@triton.jit
def _race_pick_row(xs, noise, scratch, tops, tested_x, tested_col, p_rows, sums, out, C, V,
                   stride_n, i_r, K: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr,
                   CAP: tl.constexpr, HALVINGS: tl.constexpr):
    i_r64 = tl.cast(i_r, tl.int64)
    o_c, o_k = tl.arange(0, CP), tl.arange(0, K)
    b_s = sums + i_r64 * C * (1 + K) + o_c * (1 + K)
    total = tl.sum(tl.load(b_s, mask=o_c < C, other=0.0), 0)
    before = tl.sum(tl.load(b_s[:, None] + 1 + o_k[None, :], mask=o_c[:, None] < C,
                            other=0.0), 0)
    top = tl.load(tops + i_r)
    floor = top + tl.load(p_rows + i_r * 6 + 2)
    target = tl.load(p_rows + i_r * 6 + 1) * total  # (inf: top-p off)
    c_x = tl.load(tested_x + i_r * K + o_k)
    c_col = tl.load(tested_col + i_r * K + o_k)
    survives = c_x >= floor
    kept = (c_col >= 0) & survives & (before < target)
    first = tl.min(tl.where(kept, o_k, K), 0)
    if first < K:
        token = tl.sum(tl.where(o_k == first, c_col, 0), 0).to(tl.int64)
    else:  # (any tested token bounds the search: one with that much mass before it is at
        # or below the least kept e, a surviving one with less at or above it)
        c_e = tl.exp(c_x - top)
        lo_e = tl.max(tl.where(before >= target, c_e, 0.0), 0)
        hi_e = tl.min(tl.where(survives & (before < target), c_e, 1.0), 0)
        token = _exact_draw(xs + i_r64 * V, noise + i_r64 * stride_n, scratch + i_r64 * CAP,
                            top, floor, target, lo_e, hi_e, V, BLOCK, CAP,
                            HALVINGS).to(tl.int64)
    tl.store(out + i_r, tl.minimum(tl.maximum(token, 0), V - 1))


@triton.jit(do_not_specialize=["R", "NUM_PROGS"])
def _race_pick_kernel(xs, noise, scratch, tops, tested_x, tested_col, p_rows, sums, out, C, V,
                      stride_n, R, NUM_PROGS, PID0, LOOP: tl.constexpr, K: tl.constexpr,
                      CP: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                      HALVINGS: tl.constexpr):
    """A row's token: the first tested token (largest race value first) that min-p and top-p
    keep (one whose mass before it, over the survivors' sum, is below top-p), else
    _exact_draw's."""
    if LOOP:
        for i_r in range(tl.program_id(0) + PID0, R, NUM_PROGS):
            _race_pick_row(xs, noise, scratch, tops, tested_x, tested_col, p_rows, sums, out, C,
                           V, stride_n, i_r, K, CP, BLOCK, CAP, HALVINGS)
    else:  # one program per row
        _race_pick_row(xs, noise, scratch, tops, tested_x, tested_col, p_rows, sums, out, C, V,
                       stride_n, tl.program_id(0) + PID0, K, CP, BLOCK, CAP, HALVINGS)


def sample_vocabulary(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts_rows: torch.Tensor,
    params: torch.Tensor,
    counts: torch.Tensor | None,
    in_prompt: torch.Tensor | None,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Four kernels, no sort: each chunk of _CHUNK columns stores its penalised, scaled logits
    and keeps its _RACE largest race values; each row's work merges them into its _TESTED
    likeliest draws; each chunk sums the mass before each of them; each row's work then
    takes the first one min-p and top-p keep (else draws exactly, by a search of the
    least kept probability: _exact_draw)."""
    R, V = rows.shape[0], logits.shape[-1]
    chunks = triton.cdiv(V, _CHUNK)
    _check_vocabulary(logits, R, params, counts, in_prompt, noise)
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    dev, params = logits.device, params.contiguous()
    xs, maxes, keys, tops, tested_x, tested_col, sums, scratch = _race_scratch(R, V, chunks, dev)
    has_counts = counts is not None
    items = R * chunks  # (a row's chunks)
    rows_grid, rows_loop = persistent_grid(R, dev)
    items_grid, items_programs, items_loop = _chunk_grid(R, chunks, dev)
    launch(
        _race_chunk_kernel, items_grid,
        logits, rows, counts_rows, params, counts if has_counts else logits,
        in_prompt.view(torch.uint8) if has_counts else logits, noise, xs, maxes, keys, V,
        rows.stride(0), counts_rows.stride(0), logits.stride(0),
        counts.stride(0) if has_counts else 0, noise.stride(0), chunks, items, items_programs,
        LOOP=items_loop, HAS_COUNTS=has_counts, RACE=_RACE, BLOCK=_CHUNK,
        **cuda_hints(dev, num_warps=8),
    )
    launch(
        _race_merge_kernel, (rows_grid,),
        maxes, keys, xs, tops, tested_x, tested_col, chunks, chunks * _RACE, V, R, rows_grid,
        LOOP=rows_loop, RACE=_RACE, K=_TESTED, CP=max(16, triton.next_power_of_2(chunks)),
        NP=max(16, triton.next_power_of_2(chunks * _RACE)), **cuda_hints(dev, num_warps=4),
    )
    launch(_race_mass_kernel, items_grid, xs, tops, tested_x, tested_col, params, sums, V,
           chunks, items, items_programs, LOOP=items_loop, K=_TESTED, BLOCK=_CHUNK, SUB=_SUB,
           **cuda_hints(dev, num_warps=8))
    launch(
        _race_pick_kernel, (rows_grid,),
        xs, noise, scratch, tops, tested_x, tested_col, params, sums, out, chunks, V,
        noise.stride(0), R, rows_grid, LOOP=rows_loop, K=_TESTED,
        CP=max(16, triton.next_power_of_2(chunks)), BLOCK=_CHUNK, CAP=_CAP, HALVINGS=_HALVINGS,
        **cuda_hints(dev, num_warps=8),
    )
    return out


def _check_vocabulary(logits: torch.Tensor, R: int, params: torch.Tensor,
                      counts: torch.Tensor | None, in_prompt: torch.Tensor | None,
                      noise: torch.Tensor) -> None:
    """sample_vocabulary's checks: the noise and the vocabulary's size, then the rest as
    penalize_logits checks them."""
    V = logits.shape[-1]
    if (noise.shape != (R, V) or noise.dtype != torch.float32 or noise.stride(-1) != 1
            or triton.cdiv(V, _CHUNK) * _RACE > MAX_CANDIDATES):
        raise ValueError(f"sample_vocabulary needs noise [{R}, {V}] float32 with unit column "
                         f"stride and a vocabulary of at most {MAX_CANDIDATES // _RACE * _CHUNK}")
    _check_penalize(logits, R, params, counts, in_prompt)


def _race_scratch(R: int, V: int, chunks: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Uninitialised scratch of sample_vocabulary's kernels, float32 unless noted: xs [R, V]
    (penalised, scaled logits), maxes [R, chunks], keys [R, chunks * _RACE] int64, tops [R],
    tested_x [R, _TESTED], tested_col [R, _TESTED] int32, sums [R, chunks, 1 + _TESTED] and
    scratch [R, _CAP] (the exact search's)."""
    f32 = torch.float32
    return (
        torch.empty(R, V, dtype=f32, device=dev),
        torch.empty(R, chunks, dtype=f32, device=dev),
        torch.empty(R, chunks * _RACE, dtype=torch.int64, device=dev),
        torch.empty(R, dtype=f32, device=dev),
        torch.empty(R, _TESTED, dtype=f32, device=dev),
        torch.empty(R, _TESTED, dtype=torch.int32, device=dev),
        torch.empty(R, chunks, 1 + _TESTED, dtype=f32, device=dev),
        torch.empty(R, _CAP, dtype=f32, device=dev),
    )


@triton.jit
def _score_chunk_item(logits, targets, stats, keys, V, K, stride_l, C, i_r, i_v,
                      BLOCK: tl.constexpr):
    o_v = i_v * BLOCK + tl.arange(0, BLOCK)
    row = logits + tl.cast(i_r, tl.int64) * stride_l
    b_x = tl.load(row + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
    target = tl.load(row + tl.load(targets + i_r)).to(tl.float32)
    top = tl.max(b_x, 0)
    total = tl.where(top == float("-inf"), 0.0, tl.sum(tl.exp(b_x - top), 0))
    above = tl.sum((b_x > target).to(tl.float32), 0)
    chunk = tl.cast(i_r * C + i_v, tl.int64)
    tl.store(stats + chunk * 3, top)
    tl.store(stats + chunk * 3 + 1, total)
    tl.store(stats + chunk * 3 + 2, above)
    _store_chunk_keys(b_x, V, i_v, keys, chunk * K, K, BLOCK)


@triton.jit(do_not_specialize=["K", "NUM_ITEMS", "NUM_PROGS"])
def _score_chunk_kernel(logits, targets, stats, keys, V, K, stride_l, C, NUM_ITEMS, NUM_PROGS,
                        PID0, LOOP: tl.constexpr, BLOCK: tl.constexpr):
    """Of one row's chunk of BLOCK logits: the max, the sum of exp(logit - max), how many
    exceed the row's target token's logit (stats [R, chunks, 3]), and the keys of the K
    largest (_store_chunk_keys)."""
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
            _score_chunk_item(logits, targets, stats, keys, V, K, stride_l, C, i_item // C,
                              i_item % C, BLOCK)
    else:  # one program per item, on a grid of rows x chunks
        _score_chunk_item(logits, targets, stats, keys, V, K, stride_l, C,
                          tl.program_id(0) + PID0, tl.program_id(1), BLOCK)


@triton.jit
def _score_merge_row(logits, targets, stats, keys, out, C, N, K, stride_l, stride_o, i_r,
                     CP: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr):
    i_r64 = tl.cast(i_r, tl.int64)
    o_c = tl.arange(0, CP)
    b_st = stats + i_r64 * C * 3 + o_c * 3
    b_m = tl.load(b_st, mask=o_c < C, other=float("-inf"))
    top = tl.max(b_m, 0)
    b_s = tl.load(b_st + 1, mask=o_c < C, other=0.0)
    lse = top + tl.log(tl.sum(tl.where(b_m == float("-inf"), 0.0, b_s * tl.exp(b_m - top)),
                              0))
    rank = tl.sum(tl.load(b_st + 2, mask=o_c < C, other=0.0), 0) + 1
    target = tl.load(logits + i_r64 * stride_l + tl.load(targets + i_r)).to(tl.float32)
    b_v, b_t = _merged_top(keys, i_r, N, K, NP, KP)
    o_k = tl.arange(0, KP)
    o = out + i_r64 * stride_o
    tl.store(o, tl.maximum(target - lse, -9999.0))
    tl.store(o + 1 + o_k, tl.maximum(b_v - lse, -9999.0), mask=o_k < K)
    tl.store(o + 1 + K + o_k, b_t.to(tl.float32), mask=o_k < K)
    tl.store(o + 1 + 2 * K, rank)


@triton.jit(do_not_specialize=["N", "K", "R", "NUM_PROGS"])
def _score_merge_kernel(logits, targets, stats, keys, out, C, N, K, stride_l, stride_o, R,
                        NUM_PROGS, PID0, LOOP: tl.constexpr, CP: tl.constexpr, NP: tl.constexpr,
                        KP: tl.constexpr):
    """A row's log-sum-exp from its C chunks' stats, then its table row: the target's
    log-probability, the K largest and their columns (_merged_top), the target's rank."""
    if LOOP:
        for i_r in range(tl.program_id(0) + PID0, R, NUM_PROGS):
            _score_merge_row(logits, targets, stats, keys, out, C, N, K, stride_l, stride_o, i_r,
                             CP, NP, KP)
    else:  # one program per row
        _score_merge_row(logits, targets, stats, keys, out, C, N, K, stride_l, stride_o,
                         tl.program_id(0) + PID0, CP, NP, KP)


def score_logits(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Two kernels: each chunk of _CHUNK columns of a row reduces its logits (max, sum of
    exponentials, count above the target) and keeps its k best; each row's work merges them
    into the table row. The logits are read once, in their own dtype."""
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
    grid, programs, loop = _chunk_grid(R, chunks, logits.device)
    launch(_score_chunk_kernel, grid, logits, targets, stats, keys, V, k, logits.stride(0),
           chunks, R * chunks, programs, LOOP=loop, BLOCK=_CHUNK,
           **cuda_hints(logits.device, num_warps=8))
    np_, kp = _merge_sizes(chunks, k)
    grid, loop = persistent_grid(R, logits.device)
    launch(
        _score_merge_kernel, (grid,),
        logits, targets, stats, keys, out, chunks, chunks * k, k, logits.stride(0), out.stride(0),
        R, grid, LOOP=loop, CP=max(16, triton.next_power_of_2(chunks)), NP=np_, KP=kp,
        **cuda_hints(logits.device, num_warps=8),
    )
    return out
