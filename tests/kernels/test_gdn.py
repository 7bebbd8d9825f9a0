"""The Triton GDN kernels match the float64 torch reference and touch exactly the right slots.

What this proves, for `kernels.gdn_chunk.chunk_gdn` (prefill) and
`kernels.gdn_recurrent.recurrent_gdn` (decode):
- outputs, final states and checkpoint states equal `kernels.reference` run in float64 on the
  same inputs: relative error max|out - ref| / max|ref| <= 1e-5 for float32 inputs and <= 1e-2
  for bfloat16/float16 inputs;
- varlen batches mixing lengths 1, 63, 64, 65 and 200 in shuffled order, grouped value heads,
  source slots that include the null slot 0 (filled with NaN, so reading it would show),
  a sequence whose source slot is its destination (in place), and several checkpoints per
  sequence, all in one call;
- every slot that must be written (destinations, checkpoints) is fully written (it was NaN
  before the call) and every other slot is left bit-identical;
- inputs of the wrong shape or dtype are refused with a clear ValueError.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 on small heads; with CUDA
the same tests run on the GPU, plus Qwen3.5 head shapes (H=16, HV=32/48, K=V=128).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton")

from kernels import gdn_chunk, reference
from kernels.gdn_chunk import chunk_gdn
from kernels.gdn_recurrent import recurrent_gdn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_CUDA = DEVICE == "cuda"
LENGTHS = [1, 63, 64, 65, 200]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

# ((H, HV, K, V), dtype): small heads everywhere, Qwen3.5 heads where kernels run compiled
SMALL, ODD = (2, 4, 16, 16), (1, 3, 32, 16)
QWEN16, QWEN32, QWEN48 = (16, 16, 128, 128), (16, 32, 128, 128), (16, 48, 128, 128)
CASES = [
    (SMALL, torch.float32),
    (SMALL, torch.bfloat16),
    (ODD, torch.float32),
    (ODD, torch.bfloat16),
]
if ON_CUDA:  # production shapes first: a device fault ends every later CUDA test of the process
    CASES = [
        (QWEN16, torch.bfloat16),  # one sequence fills under half the SMs: the fine state tile
        (QWEN32, torch.float32),
        (QWEN32, torch.bfloat16),
        (QWEN48, torch.float32),
        (QWEN48, torch.bfloat16),
        (QWEN48, torch.float16),
        (SMALL, torch.float16),
    ] + CASES
CASE_IDS = [
    "H{}-HV{}-K{}-V{}-".format(*shape) + str(dtype).removeprefix("torch.") for shape, dtype in CASES
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.contiguous().view(torch.int32), y.contiguous().view(torch.int32))


def _inputs(num_tokens: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype) -> dict:
    """Fresh random GDN inputs on DEVICE; a, b spread so that decays and betas vary widely."""
    return {
        "q": torch.randn(num_tokens, H, K, dtype=dtype, device=DEVICE),
        "k": torch.randn(num_tokens, H, K, dtype=dtype, device=DEVICE),
        "v": torch.randn(num_tokens, HV, V, dtype=dtype, device=DEVICE),
        "a": (2 * torch.randn(num_tokens, HV, device=DEVICE)).to(dtype),
        "b": (2 * torch.randn(num_tokens, HV, device=DEVICE)).to(dtype),
        "A_log": torch.rand(HV, device=DEVICE) * 2 - 1.5,
        "dt_bias": torch.randn(HV, device=DEVICE),
    }


class SlotPlan:
    """A state pool with source slots, NaN-poisoned targets and spare slots for N sequences.

    Slot 0 is the null slot, filled with NaN: a kernel that reads it produces NaN. Sequence i
    reads `src[i]` (0 for some sequences) and writes `dst[i]`; the sequence `in_place` has
    dst == src. Extra targets (checkpoints) come from `take()`.
    """

    def __init__(self, num_seqs: int, HV: int, K: int, V: int, num_extra: int, rng: random.Random):
        num_slots = 1 + 2 * num_seqs + num_extra + 2
        self.pool = torch.randn(num_slots, HV, K, V, device=DEVICE)
        self.pool[0] = float("nan")
        sources = list(range(1, num_seqs + 1))
        self.src = [s if rng.random() < 0.6 else 0 for s in sources]
        self.src[0], self.src[1] = 0, sources[1]  # at least one null and one real source
        self.in_place = rng.randrange(1, num_seqs)
        if self.src[self.in_place] == 0:
            self.src[self.in_place] = sources[self.in_place]
        self._free = list(range(num_seqs + 1, num_slots - 2))  # the last 2 slots stay spare
        self.dst = [self.src[i] if i == self.in_place else self.take() for i in range(num_seqs)]

    def take(self) -> int:
        slot = self._free.pop(0)
        self.pool[slot] = float("nan")
        return slot

    def ref_pool(self) -> torch.Tensor:
        """float64 copy for the reference, whose recurrent_gdn multiplies slot 0 by 0 (NaN * 0)."""
        pool = self.pool.double()
        pool[0] = 0.0
        return pool

    def slots(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _check_pool(
    pool: torch.Tensor, before: torch.Tensor, ref: torch.Tensor, written: set[int], tol: float
):
    for slot in range(pool.shape[0]):
        if slot in written:
            assert torch.isfinite(pool[slot]).all(), f"slot {slot} not fully written"
            err = _rel_err(pool[slot], ref[slot])
            assert err <= tol, f"slot {slot}: relative error {err:.2e} > {tol:.0e}"
        else:
            assert _same_bits(pool[slot], before[slot]), f"slot {slot} must not be written"


def _as_f64(inputs: dict) -> dict:
    return {name: x.double() for name, x in inputs.items()}


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=CASE_IDS)
def test_chunk_gdn_varlen_matches_reference(shape, dtype):
    H, HV, K, V = shape
    rng = random.Random(f"chunk-{shape}-{dtype}")
    lengths = LENGTHS[:]
    rng.shuffle(lengths)
    num_seqs = len(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    inputs = _inputs(cu[-1], H, HV, K, V, dtype)

    # every block boundary inside each sequence: 64, 128, 192 for the 200-long one, ...
    targets = [
        (i, bd)
        for i, n in enumerate(lengths)
        for bd in range(reference.CHUNK, n + 1, reference.CHUNK)
    ]
    rng.shuffle(targets)
    plan = SlotPlan(num_seqs, HV, K, V, len(targets), rng)
    ckpt_slots = [plan.take() for _ in targets]
    checkpoints = reference.Checkpoints(
        seq=plan.slots([i for i, _ in targets]),
        boundary=plan.slots([bd for _, bd in targets]),
        slot=plan.slots(ckpt_slots),
    )
    cu_seqlens = plan.slots(cu)
    src, dst = plan.slots(plan.src), plan.slots(plan.dst)

    before = plan.pool.clone()
    ref_pool = plan.ref_pool()
    ref = reference.chunk_gdn(
        **_as_f64(inputs),
        state_pool=ref_pool,
        cu_seqlens=cu_seqlens,
        src_slots=src,
        dst_slots=dst,
        checkpoints=checkpoints,
    )
    out = chunk_gdn(
        **inputs,
        state_pool=plan.pool,
        cu_seqlens=cu_seqlens,
        src_slots=src,
        dst_slots=dst,
        checkpoints=checkpoints,
    )

    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == (cu[-1], HV, V)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) <= tol, f"output relative error {_rel_err(out, ref):.2e}"
    _check_pool(plan.pool, before, ref_pool, set(plan.dst) | set(ckpt_slots), tol)


def test_the_output_kernel_sums_its_key_pieces(monkeypatch):
    """The output kernel takes the keys BK at a time (64 on Qwen3.5's 128): two pieces here."""
    monkeypatch.setitem(gdn_chunk.CONFIG["output"], "BK", 16)
    test_chunk_gdn_varlen_matches_reference(ODD, torch.float32)


@pytest.mark.skipif(not ON_CUDA, reason="its keys span 4 GiB: a GPU test")
def test_chunk_gdn_reads_keys_far_apart_in_a_long_chunk():
    """Keys 2^24 elements apart per token (a wide projection's rows): row x stride passes 2^31
    inside these 130 tokens, so the state kernel must offset its rows in int64, as a long
    prompt in one step needs with a real model's token stride."""
    H, HV, K, V = SMALL
    T, stride, dtype = 130, 1 << 24, torch.bfloat16
    inputs = _inputs(T, H, HV, K, V, dtype)
    far = torch.empty_strided((T, H, K), (stride, K, 1), dtype=dtype, device=DEVICE)
    far.copy_(inputs["k"])
    slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    null = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    cu_seqlens = torch.tensor([0, T], dtype=torch.int32, device=DEVICE)
    pool = torch.zeros(2, HV, K, V, device=DEVICE)
    ref_pool = pool.double()
    ref = reference.chunk_gdn(**_as_f64(inputs), state_pool=ref_pool, cu_seqlens=cu_seqlens,
                              src_slots=null, dst_slots=slots)
    out = chunk_gdn(**{**inputs, "k": far}, state_pool=pool, cu_seqlens=cu_seqlens,
                    src_slots=null, dst_slots=slots)
    del far
    assert _rel_err(out, ref) <= TOLERANCE[dtype]
    assert _rel_err(pool[1], ref_pool[1]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("shape", "dtype"), CASES[:2], ids=CASE_IDS[:2])
def test_the_gated_norm_fused_into_the_output_matches_the_norm_after_it(shape, dtype, fused,
                                                                        monkeypatch):
    """chunk_gdn(norm=(z, w, eps)) returns gated_rmsnorm(chunk_gdn(...), z, w, eps): computed
    in the output kernel when a head fits its tile, by the norm kernel after it otherwise; the
    gate is read in place from a wider projection. Same slots written either way."""
    from kernels import gdn_chunk
    from kernels.norms import gated_rmsnorm

    H, HV, K, V = shape
    if not fused:
        monkeypatch.setitem(gdn_chunk.CONFIG["output"], "norm_max_V", V // 2)
    lengths = [65, 1, 200]
    cu = torch.tensor([0, 65, 66, 266], dtype=torch.int32, device=DEVICE)
    inputs = _inputs(int(cu[-1]), H, HV, K, V, dtype)
    proj = torch.randn(int(cu[-1]), HV * V + 24, dtype=dtype, device=DEVICE)
    z = proj[:, 8 : 8 + HV * V].view(-1, HV, V)  # a strided slice, as the layer's split gives
    weight = torch.rand(V, dtype=dtype, device=DEVICE) + 0.5
    slots = torch.arange(1, len(lengths) + 1, dtype=torch.int32, device=DEVICE)
    pool = torch.randn(len(lengths) + 1, HV, K, V, device=DEVICE)
    pools = [pool, pool.clone()]
    src = torch.zeros_like(slots)
    plain = chunk_gdn(**inputs, state_pool=pools[0], cu_seqlens=cu, src_slots=src, dst_slots=slots)
    normed = chunk_gdn(**inputs, state_pool=pools[1], cu_seqlens=cu, src_slots=src, dst_slots=slots,
                       norm=(z, weight, 1e-6))
    want = gated_rmsnorm(plain, z, weight, 1e-6)
    assert normed.shape == want.shape and normed.dtype == want.dtype
    # the same float32 arithmetic on the same rounded o: equal up to the order of one row sum
    ulp = 1e-6 if dtype == torch.float32 else 1e-2
    close = bool(((normed.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all())
    same_states = _same_bits(pools[0], pools[1])
    assert close and same_states
    # refused before any state is written
    with pytest.raises(ValueError, match="norm wants a gate"):
        chunk_gdn(**inputs, state_pool=pools[1], cu_seqlens=cu, src_slots=src, dst_slots=slots + 10,
                  norm=(z[:, :, 1:], weight[1:], 1e-6))


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=CASE_IDS)
def test_recurrent_gdn_matches_reference(shape, dtype):
    H, HV, K, V = shape
    rng = random.Random(f"recurrent-{shape}-{dtype}")
    num_seqs = 64 if ON_CUDA else 5
    inputs = _inputs(num_seqs, H, HV, K, V, dtype)
    plan = SlotPlan(num_seqs, HV, K, V, 0, rng)
    src, dst = plan.slots(plan.src), plan.slots(plan.dst)

    before = plan.pool.clone()
    ref_pool = plan.ref_pool()
    ref = reference.recurrent_gdn(
        **_as_f64(inputs), state_pool=ref_pool, src_slots=src, dst_slots=dst
    )
    out = recurrent_gdn(**inputs, state_pool=plan.pool, src_slots=src, dst_slots=dst)

    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == (num_seqs, HV, V)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) <= tol, f"output relative error {_rel_err(out, ref):.2e}"
    _check_pool(plan.pool, before, ref_pool, set(plan.dst), tol)


def test_chunk_then_decode_continues_the_sequence():
    """A prefill of 64 tokens then one decode step equals the reference over all 65 tokens."""
    H, HV, K, V = SMALL
    inputs = _inputs(65, H, HV, K, V, torch.float32)
    pool = torch.zeros(3, HV, K, V, device=DEVICE)
    ref_pool = pool.double()
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    prefill = {name: x[:64] if x.dim() > 1 else x for name, x in inputs.items()}
    decode = {name: x[64:] if x.dim() > 1 else x for name, x in inputs.items()}
    out = torch.cat(
        [
            chunk_gdn(
                **prefill,
                state_pool=pool,
                cu_seqlens=torch.tensor([0, 64], dtype=torch.int32, device=DEVICE),
                src_slots=zero,
                dst_slots=one,
            ),
            recurrent_gdn(**decode, state_pool=pool, src_slots=one, dst_slots=one),
        ]
    )
    ref = reference.chunk_gdn(
        **_as_f64(inputs),
        state_pool=ref_pool,
        cu_seqlens=torch.tensor([0, 65], dtype=torch.int32, device=DEVICE),
        src_slots=zero,
        dst_slots=one,
    )
    assert _rel_err(out, ref) <= 1e-5
    assert _rel_err(pool[1], ref_pool[1]) <= 1e-5


def test_bad_inputs_are_refused():
    H, HV, K, V = SMALL
    inputs = _inputs(4, H, HV, K, V, torch.float32)
    slots = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="state_pool must be float32"):
        recurrent_gdn(
            **inputs,
            state_pool=torch.zeros(2, HV, K, V, dtype=torch.float64, device=DEVICE),
            src_slots=slots,
            dst_slots=slots,
        )
    bad = dict(inputs, v=torch.randn(4, HV + 1, V, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of key heads"):
        recurrent_gdn(
            **bad,
            state_pool=torch.zeros(2, HV + 1, K, V, device=DEVICE),
            src_slots=slots,
            dst_slots=slots,
        )
    with pytest.raises(ValueError, match="must have contiguous heads"):
        chunk_gdn(
            **dict(inputs, q=inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)),
            state_pool=torch.zeros(2, HV, K, V, device=DEVICE),
            cu_seqlens=torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
            src_slots=slots[:1],
            dst_slots=slots[:1],
        )


def test_a_layout_made_once_serves_every_layer():
    """chunk_layout's bookkeeping, made once per step, gives what chunk_gdn computes itself;
    a layout of another step is refused."""
    from kernels import gdn_chunk

    torch.manual_seed(3)
    lens, H, HV, K = [70, 130], 2, 4, 16
    T = sum(lens)
    cu = torch.tensor([0, lens[0], T], dtype=torch.int32, device=DEVICE)
    q, k = torch.randn(T, H, K, device=DEVICE), torch.randn(T, H, K, device=DEVICE)
    v, a, b = (torch.randn(*s, device=DEVICE) for s in ((T, HV, K), (T, HV), (T, HV)))
    A_log, dt_bias = torch.rand(HV, device=DEVICE) - 1.5, torch.randn(HV, device=DEVICE)
    src, dst = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([1, 0], [2, 3]))
    ck = reference.Checkpoints(*(torch.tensor(x, dtype=torch.int32, device=DEVICE)
                                 for x in ([1, 1], [64, 128], [4, 5])))
    outs = []
    for layout in (None, gdn_chunk.chunk_layout(cu, T, ck)):
        torch.manual_seed(0)
        pool = torch.randn(6, HV, K, K, device=DEVICE) * 0.1
        o = gdn_chunk.chunk_gdn(q, k, v, a, b, A_log, dt_bias, pool, cu, src, dst, ck, layout)
        outs.append((o, pool))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    other = gdn_chunk.chunk_layout(cu[:2], lens[0], None)
    with pytest.raises(ValueError, match="layout is for another step"):
        gdn_chunk.chunk_gdn(q, k, v, a, b, A_log, dt_bias, outs[0][1], cu, src, dst, ck, other)
    # the state kernel reads each chunk's checkpoint slot one chunk ahead: the map needs an
    # entry past the last chunk
    short = gdn_chunk.chunk_layout(cu, T, ck)
    short = short._replace(ckpt_slots=short.ckpt_slots[:-1])
    with pytest.raises(ValueError, match="checkpoint entries, want"):
        gdn_chunk.chunk_gdn(q, k, v, a, b, A_log, dt_bias, outs[0][1], cu, src, dst, ck, short)


def test_one_sequence_on_a_large_device_takes_the_fine_state_tile(monkeypatch):
    """A grid that would leave half the cores idle (16 value heads of one sequence on an H100)
    runs the state kernel with the fine V tile on 2 warps: output, final state and checkpoint
    match the reference."""
    from kernels import gdn_chunk

    monkeypatch.setattr(gdn_chunk, "num_cube_cores", lambda device: 132)  # an H100
    H, HV, K, V = (16, 16, 128, 128) if ON_CUDA else (2, 4, 16, 32)
    assert gdn_chunk._state_tile(HV, V, torch.device(DEVICE)) == (16, 2)
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    T = 200
    inputs = _inputs(T, H, HV, K, V, dtype)
    pool = torch.randn(4, HV, K, V, device=DEVICE)
    pool[2:] = float("nan")  # the final state's and the checkpoint's slots: written whole

    def slots(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    args = {"cu_seqlens": slots(0, T), "src_slots": slots(1), "dst_slots": slots(2),
            "checkpoints": reference.Checkpoints(slots(0), slots(128), slots(3))}
    ref_pool = pool.double()
    ref = reference.chunk_gdn(**_as_f64(inputs), state_pool=ref_pool, **args)
    out = chunk_gdn(**inputs, state_pool=pool, **args)
    tol = TOLERANCE[dtype]
    assert _rel_err(out, ref) <= tol
    for slot in (2, 3):
        assert torch.isfinite(pool[slot]).all() and _rel_err(pool[slot], ref_pool[slot]) <= tol


def test_padding_sequences_do_not_count_for_the_state_tile(monkeypatch):
    """A prefill graph's chunk comes with a padding sequence: the layout says so, and the state
    kernel's tile is chosen for the real sequence alone (same outputs either way)."""
    from kernels import gdn_chunk

    monkeypatch.setattr(gdn_chunk, "num_cube_cores", lambda device: 132)  # an H100
    rows = []
    choose = gdn_chunk._state_tile
    monkeypatch.setattr(gdn_chunk, "_state_tile", lambda n, *a: rows.append(n) or choose(n, *a))
    H, HV, K, V = (16, 16, 128, 128) if ON_CUDA else (2, 4, 16, 32)
    T = 200
    cu = torch.tensor([0, 136, T], dtype=torch.int32, device=DEVICE)
    inputs = _inputs(T, H, HV, K, V, torch.float32)
    src, dst = (torch.tensor(s, dtype=torch.int32, device=DEVICE) for s in ([1, 0], [2, 3]))
    outs = []
    for pad in (0, 1):
        seed = torch.Generator(DEVICE).manual_seed(1)
        pool = torch.randn(4, HV, K, V, device=DEVICE, generator=seed)
        layout = gdn_chunk.chunk_layout(cu, T, None, pad_seqs=pad)
        assert layout.busy_seqs == 2 - pad
        o = chunk_gdn(**inputs, state_pool=pool, cu_seqlens=cu, src_slots=src, dst_slots=dst,
                      layout=layout)
        outs.append((o, pool))
    assert rows == [2 * HV, HV]
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="padding sequences"):
        gdn_chunk.chunk_layout(cu, T, None, pad_seqs=2)


def test_state_tile_counts_name_the_fewest_sequences_of_each_tile(monkeypatch):
    """The warm-up's step sizes: on an H100, 16 heads of 128 take the fine tile alone, the
    narrow one at two sequences and the wide one from three; every tile up to `most` has its
    count, the first that takes it."""
    from kernels import gdn_chunk

    monkeypatch.setattr(gdn_chunk, "num_cube_cores", lambda device: 132)  # an H100
    device = torch.device(DEVICE)
    for heads, width in ((16, 128), (4, 128), (48, 128), (4, 32)):
        counts = gdn_chunk.state_tile_counts(heads, width, device, 64)
        tiles = [gdn_chunk._state_tile(n * heads, width, device) for n in range(1, 65)]
        assert counts == [n for n in range(1, 65) if tiles[n - 1] not in tiles[: n - 1]]
    assert gdn_chunk.state_tile_counts(16, 128, device, 64) == [1, 2, 3]
    assert gdn_chunk.state_tile_counts(16, 128, device, 2) == [1, 2]


@pytest.mark.parametrize("many", [8, 9])
def test_the_prepare_kernel_takes_its_warps_by_tokens_not_sequences(many, monkeypatch):
    """2 warps from `many` full chunks x heads per core up, counted from the tokens alone: a step
    of as many tokens in more sequences takes the same kernel (which the largest prefill graph,
    of one sequence, has built)."""
    monkeypatch.setattr(gdn_chunk, "num_cube_cores", lambda device: 1)
    monkeypatch.setattr(gdn_chunk, "cuda_hints", lambda device, **hints: hints)  # as on CUDA
    monkeypatch.setitem(gdn_chunk.CONFIG["prepare"], "many", many)
    warps, kernel = [], gdn_chunk._gdn_prepare_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: warps.append(kw["num_warps"]) or kernel[grid](*args, **kw)

    monkeypatch.setattr(gdn_chunk, "_gdn_prepare_kernel", Spy())
    H, HV, K, V = SMALL  # 150 tokens: 2 full chunks x 4 heads
    inputs = _inputs(150, H, HV, K, V, torch.float32)
    pool = torch.zeros(8, HV, K, V, device=DEVICE)
    for cu in ([0, 150], [0, 50, 100, 150]):
        n = len(cu) - 1
        slots = torch.arange(1, n + 1, dtype=torch.int32, device=DEVICE)
        chunk_gdn(**inputs, state_pool=pool, cu_seqlens=torch.tensor(cu, dtype=torch.int32,
                  device=DEVICE), src_slots=slots, dst_slots=slots)
    cfg = gdn_chunk.CONFIG["prepare"]
    assert warps == [cfg["many_warps"] if many <= 8 else cfg["num_warps"]] * 2
