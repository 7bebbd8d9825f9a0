"""The one-row linears (decode at batch 1) compute what the reference ops do.

Each fused op is checked against its unfused reference (the residual add and norm, or SwiGLU,
then F.linear) in float32 and bf16: the prologue's roundings are the reference's, so only the
order of the float32 sums differs. Widths that are not multiples of the tiles, strided input
rows (a slice of a wider projection output), rows in one tile or walked in tiles (wider than
WHOLE_ROW) and the new residual are covered; more rows than GEMV_MAX_ROWS must take the
unfused path (its new residual bit-exact).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import gemv, reference
from kernels.gemv import (
    GEMV_MAX_ROWS,
    WHOLE_ROW,
    add_rmsnorm_linear,
    add_rmsnorm_logits,
    gated_rmsnorm_linear,
    linear,
    silu_mul_linear,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def weight(N: int, K: int, dtype, device) -> torch.Tensor:
    return (torch.randn(N, K, device=device) / K**0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1])
@pytest.mark.parametrize("N,K", [(40, 96), (257, 640), (16, WHOLE_ROW + 300)])
def test_linear(device, dtype, M, N, K):  # M = 1: the kernel (more rows: see below)
    x = torch.randn(M, 2 * K, device=device).to(dtype)[:, :K]  # strided rows
    w = weight(N, K, dtype, device)
    out = linear(x, w)
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, reference.linear(x, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1])
@pytest.mark.parametrize("N,K", [(40, 96), (130, 640), (24, WHOLE_ROW + 300)])
def test_add_rmsnorm_linear(device, dtype, M, N, K):
    x = (torch.randn(M, K, device=device) * 2).to(dtype)
    residual = torch.randn(M, K, device=device).to(dtype)
    norm_w = (0.5 * torch.randn(K, device=device)).to(dtype)
    w = weight(N, K, dtype, device)
    out, total = add_rmsnorm_linear(x, residual, norm_w, EPS, w)
    ref_out, ref_total = reference.add_rmsnorm_linear(x, residual, norm_w, EPS, w)
    assert torch.equal(total, ref_total)  # the next residual: one rounded add, bit-exact
    assert rel_err(out, ref_out) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(40, 96), (1000, 640), (300, WHOLE_ROW + 300)])
def test_add_rmsnorm_logits(device, dtype, N, K):
    """The lm_head of a decode step: float32 logits (the projection rounded to the input dtype
    first, as the reference) and, from the same kernel, their argmax."""
    x = (torch.randn(1, K, device=device) * 2).to(dtype)
    residual = torch.randn(1, K, device=device).to(dtype)
    norm_w = (0.5 * torch.randn(K, device=device)).to(dtype)
    w = weight(N, K, dtype, device)
    logits, greedy = add_rmsnorm_logits(x, residual, norm_w, EPS, w)
    ref_logits, _ = reference.add_rmsnorm_logits(x, residual, norm_w, EPS, w)
    assert logits.dtype == torch.float32 and greedy.dtype == torch.int64 and greedy.shape == (1,)
    assert torch.equal(logits, logits.to(dtype).float())  # rounded as the projection
    assert rel_err(logits, ref_logits) < TOL[dtype]
    assert torch.equal(greedy, logits.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 3])
def test_the_logits_argmax_takes_the_first_of_equal_maxima(device, rows, monkeypatch):
    """Equal largest logits in one tile, in a later tile of the same program and in the tiles
    of other programs: the first column wins, as with torch.argmax (rows past GEMV_MAX_ROWS:
    the kernel is row-generic)."""
    from kernels.gemv import _ADD_RMSNORM, _launch

    # 64-column tiles and 8 programs on any device, so program 0 walks tiles 0, 8, ...
    monkeypatch.setitem(gemv.CUDA_GEMV, "programs_per_core", 1)
    monkeypatch.setattr(gemv, "num_cores", lambda device: 8)
    N, K = 1000, 96
    w = weight(N, K, torch.float32, device)
    x, residual = torch.randn(rows, K, device=device), torch.randn(rows, K, device=device)
    norm_w = torch.randn(K, device=device)
    top = 3 * w[5].abs().max() * torch.sign(reference.add_rmsnorm(x, residual, norm_w, EPS)[0][0])
    for col in (900, 530, 41, 37, 700):  # 37 and 41 share a tile, 530 is in a later one
        w[col] = top
    greedy = torch.empty(rows, dtype=torch.int64, device=device)
    logits, _ = _launch(x, w, _ADD_RMSNORM, K, residual, norm_w, EPS, argmax=greedy)
    assert logits[0, 37] == logits[0, 700] == logits.max()
    assert greedy[0] == 37 and torch.equal(greedy, logits.argmax(dim=-1))


def test_more_rows_of_logits_take_the_unfused_ops(device, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the GEMV kernel ran for more rows than GEMV_MAX_ROWS")

    monkeypatch.setattr(gemv, "_launch", no_kernel)
    M, N, K = GEMV_MAX_ROWS + 1, 50, 64
    x, residual = torch.randn(M, K, device=device), torch.randn(M, K, device=device)
    norm_w, w = torch.randn(K, device=device), weight(N, K, torch.float32, device)
    logits, greedy = add_rmsnorm_logits(x, residual, norm_w, EPS, w)
    ref_logits, _ = reference.add_rmsnorm_logits(x, residual, norm_w, EPS, w)
    assert rel_err(logits, ref_logits) < TOL[torch.float32]
    assert torch.equal(greedy, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1])
@pytest.mark.parametrize("N,I", [(40, 96), (64, 600), (8, WHOLE_ROW + 300)])
def test_silu_mul_linear(device, dtype, M, N, I):
    x = (torch.randn(M, 3 * I, device=device) * 2).to(dtype)[:, : 2 * I]  # strided rows
    w = weight(N, I, dtype, device)
    out = silu_mul_linear(x, w)
    assert out.shape == (M, N)
    assert rel_err(out, reference.silu_mul_linear(x, w)) < TOL[dtype]


def gdn_output(T: int, H: int, D: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's o [T, H, D] and its gate z: a view of a wider projection, as in the model."""
    o = (torch.randn(T, H, D, device=device) * 2).to(dtype)
    proj = torch.randn(T, H * D + 40, device=device).to(dtype)
    return o, proj[:, 24 : 24 + H * D].view(T, H, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D,N", [(4, 32, 40), (3, 64, 130), (16, 128, 24)])
def test_gated_rmsnorm_linear_runs_the_kernel_and_matches(device, dtype, H, D, N, monkeypatch):
    """Heads of a power-of-two width, rows up to WHOLE_ROW: one kernel (the unfused norm must
    not run), and the result of the norm then the projection."""
    def no_norm(*args, **kwargs):
        raise AssertionError("the unfused gated norm ran")

    monkeypatch.setattr(gemv, "gated_rmsnorm", no_norm)
    o, z = gdn_output(1, H, D, dtype, device)
    norm_w = (1 + 0.5 * torch.randn(D, device=device)).to(dtype)
    w = weight(N, H * D, dtype, device)
    out = gated_rmsnorm_linear(o, z, norm_w, EPS, w)
    assert out.shape == (1, N) and out.dtype == dtype
    assert rel_err(out, reference.gated_rmsnorm_linear(o, z, norm_w, EPS, w)) < TOL[dtype]


@pytest.mark.parametrize("T,H,D", [(2, 4, 32), (1, 3, 48), (1, 2, WHOLE_ROW)])
def test_gated_rmsnorm_linear_takes_the_unfused_ops_elsewhere(device, T, H, D):
    """More rows, heads of other widths, rows wider than WHOLE_ROW and heads that are not
    contiguous in a row take the norm kernel and then the linear: same result."""
    o, z = gdn_output(T, H, D, torch.float32, device)
    norm_w, w = 1 + 0.5 * torch.randn(D, device=device), weight(24, H * D, torch.float32, device)
    want = reference.gated_rmsnorm_linear(o, z, norm_w, EPS, w)
    assert rel_err(gated_rmsnorm_linear(o, z, norm_w, EPS, w), want) < TOL[torch.float32]
    wide = torch.zeros(T, H, 2 * D, device=device)
    wide[..., :D] = o
    o_apart = wide[..., :D]  # heads strided apart (stride 2D)
    assert rel_err(gated_rmsnorm_linear(o_apart, z, norm_w, EPS, w), want) < TOL[torch.float32]
    wide[..., :D] = z
    z_apart = wide[..., :D]
    assert rel_err(gated_rmsnorm_linear(o, z_apart, norm_w, EPS, w), want) < TOL[torch.float32]


def test_gated_rmsnorm_linear_refuses_bad_operands(device):
    o, z = gdn_output(1, 4, 32, torch.float32, device)
    w = weight(8, 128, torch.float32, device)
    with pytest.raises(ValueError, match="does not match the weight"):
        gated_rmsnorm_linear(o, z, torch.ones(32, device=device), EPS, w[:, :64])
    with pytest.raises(ValueError, match="weight"):
        gated_rmsnorm_linear(o, z, torch.ones(16, device=device), EPS, w)
    with pytest.raises(ValueError, match="gate"):
        gated_rmsnorm_linear(o, z[:, :2], torch.ones(32, device=device), EPS, w)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        gated_rmsnorm_linear(o.reshape(1, 128), z, torch.ones(32, device=device), EPS, w)


def same_roundings(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal but for rare 1-ulp ties (rsqrt and sigmoid differ in the last float32 bit
    between Triton and torch): a missing rounding step moves most entries instead."""
    if out.dtype == torch.float32:
        return rel_err(out, ref) < 1e-6
    ulp = ref.double().abs() * 2.0**-7
    close = (out.double() - ref.double()).abs() <= ulp
    return bool(close.all()) and (out != ref).double().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [96, WHOLE_ROW + 300])
def test_prologues_round_like_the_reference(device, dtype, K):
    """With w[n] = e_n + e_(n+N), output n is the sum of two of the projection's inputs,
    exact in float32, so it shows whether the prologue rounded each input to the dtype as
    the unfused ops do (a single rounding at the store would hide it)."""
    N = 48
    eye = torch.eye(K, device=device)
    w = (eye[:N] + eye[N : 2 * N]).to(dtype)
    x = (torch.randn(1, K, device=device) * 2).to(dtype)
    residual = torch.randn(1, K, device=device).to(dtype)
    norm_w = (0.5 * torch.randn(K, device=device)).to(dtype)
    out, _ = add_rmsnorm_linear(x, residual, norm_w, EPS, w)
    normed, _ = reference.add_rmsnorm(x, residual, norm_w, EPS)
    want = (normed[:, :N].float() + normed[:, N : 2 * N].float()).to(dtype)
    assert same_roundings(out, want)
    gu = (torch.randn(1, 2 * K, device=device) * 2).to(dtype)
    act = reference.silu_mul(gu)
    want = (act[:, :N].float() + act[:, N : 2 * N].float()).to(dtype)
    assert same_roundings(silu_mul_linear(gu, w), want)
    if K <= WHOLE_ROW:  # the gated norm's prologue (heads of 32)
        o, z = (torch.randn(1, K // 32, 32, device=device) * 2).to(dtype), gu[:, :K].view(1, -1, 32)
        gw = (1 + 0.5 * torch.randn(32, device=device)).to(dtype)
        g = reference.gated_rmsnorm(o, z, gw, EPS).reshape(1, K)
        want = (g[:, :N].float() + g[:, N : 2 * N].float()).to(dtype)
        assert same_roundings(gated_rmsnorm_linear(o, z, gw, EPS, w), want)


def test_the_kernel_serves_any_row_count(device):
    """Rows past GEMV_MAX_ROWS normally take the library GEMM, but the kernel itself is right
    for them (it is row-generic; the limit is a speed choice)."""
    from kernels.gemv import _ADD_RMSNORM, _launch

    M, N, K = 3, 40, 96
    x, residual = torch.randn(M, K, device=device), torch.randn(M, K, device=device)
    norm_w, w = torch.randn(K, device=device), weight(N, K, torch.float32, device)
    out, total = _launch(x, w, _ADD_RMSNORM, K, residual, norm_w, EPS)
    ref_out, ref_total = reference.add_rmsnorm_linear(x, residual, norm_w, EPS, w)
    assert torch.equal(total, ref_total)
    assert rel_err(out, ref_out) < TOL[torch.float32]


def test_more_rows_take_the_unfused_path(device, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the GEMV kernel ran for more rows than GEMV_MAX_ROWS")

    monkeypatch.setattr(gemv, "_launch", no_kernel)
    M, N, K = GEMV_MAX_ROWS + 1, 24, 64
    x = torch.randn(M, K, device=device)
    residual = torch.randn(M, K, device=device)
    norm_w, w = torch.randn(K, device=device), weight(N, K, torch.float32, device)
    out, total = add_rmsnorm_linear(x, residual, norm_w, EPS, w)
    ref_out, ref_total = reference.add_rmsnorm_linear(x, residual, norm_w, EPS, w)
    assert torch.equal(total, ref_total)
    assert rel_err(out, ref_out) < TOL[torch.float32]
    gu = torch.randn(M, 2 * K, device=device)
    assert rel_err(silu_mul_linear(gu, w), reference.silu_mul_linear(gu, w)) < TOL[torch.float32]


@pytest.mark.parametrize("M", [1, GEMV_MAX_ROWS + 1])
def test_mismatched_weight_is_one_clear_error(device, M):
    x, w = torch.randn(M, 64, device=device), torch.randn(8, 32, device=device)
    with pytest.raises(ValueError, match="does not match the weight"):
        linear(x, w)
    with pytest.raises(ValueError, match="does not match the weight"):
        add_rmsnorm_linear(x, x, torch.ones(64, device=device), EPS, w)


def test_a_bad_norm_operand_is_refused_by_the_norm(device):
    x, w = torch.randn(1, 64, device=device), torch.randn(8, 64, device=device)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm_linear(x, x, torch.ones(32, device=device), EPS, w)
    with pytest.raises(ValueError, match="dtype"):
        add_rmsnorm_linear(x, x.double(), torch.ones(64, device=device), EPS, w)


def _decode_like_chain(x, res, nw, ws, conv):
    """The kernels of a decode layer's MLP and mixer, in a loop: each reads the last's output,
    and each conv step the window the last one wrote (in place)."""
    from kernels.norms import gated_rmsnorm

    for _ in range(8):
        h, res = add_rmsnorm_linear(x, res, nw, EPS, ws[0], conv)  # [1, 2I]
        y = silu_mul_linear(h, ws[1])  # [1, K]
        g = gated_rmsnorm(y.view(1, 4, -1), y.view(1, 4, -1), nw[: y.shape[1] // 4], EPS)
        x = linear(g.view(1, -1), ws[2])
        x = gated_rmsnorm_linear(x.view(1, 8, -1), y.view(1, 8, -1), nw[: x.shape[1] // 8], EPS,
                                 ws[2])
    return x, res


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs CUDA compute capability 9+")
@pytest.mark.parametrize("graph", [False, True])
def test_dependent_launches_change_no_result(monkeypatch, graph):
    """Under programmatic dependent launch each kernel starts while the one before finishes; a
    read before its wait would see stale data. The chain gives bit-identical results with it
    on and off, eagerly and replayed from a CUDA graph."""
    from kernels import hw

    assert hw.pdl(torch.device("cuda"))["USE_GDC"], "PDL should be on for this device"
    K, I = 1024, 3584
    torch.manual_seed(0)
    x = torch.randn(1, K, device="cuda").bfloat16()
    res = torch.randn(1, K, device="cuda").bfloat16()
    nw = (torch.randn(K, device="cuda") * 0.1).bfloat16()
    ws = [weight(2 * I, K, torch.bfloat16, "cuda"), weight(K, I, torch.bfloat16, "cuda"),
          weight(K, K, torch.bfloat16, "cuda")]
    conv_w, pool0 = conv_operands(1000, 4, "cuda", torch.bfloat16)
    slot = torch.tensor([2], dtype=torch.int32, device="cuda")

    def run() -> tuple[torch.Tensor, ...]:
        pool = pool0.clone()
        conv = (conv_w, pool, slot, slot)
        if not graph:
            return (*_decode_like_chain(x, res, nw, ws, conv), pool)
        _decode_like_chain(x, res, nw, ws, conv)  # compile outside the capture
        pool.copy_(pool0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _decode_like_chain(x, res, nw, ws, conv)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        return (*out, pool)

    with_pdl = run()
    monkeypatch.setattr(hw, "_pdl_ok", lambda device: False)
    without = run()
    assert all(torch.equal(a, b) for a, b in zip(with_pdl, without))


def test_dependent_launch_is_off_off_cuda():
    from kernels import hw

    assert hw.pdl(torch.device("cpu")) == {"USE_GDC": False}


def conv_operands(D: int, W: int, device, dtype=torch.float32):
    """A GDN layer's conv weight and a pool of 4 slots (slot 0: the null slot, zeros)."""
    conv_w = torch.randn(D, W, device=device).to(dtype)
    pool = torch.randn(4, W - 1, D, device=device).to(dtype)
    pool[0] = 0
    return conv_w, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "src,dst", [(2, 2), (1, 3), (0, 2)], ids=["in-place", "to-another", "null"]
)
@pytest.mark.parametrize("norm", [False, True])
def test_the_decode_conv_runs_with_the_in_projection(device, dtype, src, dst, norm, monkeypatch):
    """Output columns :D leave convolved (SiLU'd) from the projection as stored, the window
    moves from the source slot to the destination slot; other columns and slots untouched."""
    def no_conv(*args, **kwargs):
        raise AssertionError("the separate conv kernel ran")

    monkeypatch.setattr(gemv, "causal_conv1d_update_in_place", no_conv)
    N, K, D, W = 52, 96, 40, 4
    x = (torch.randn(1, K, device=device) * 2).to(dtype)
    residual = torch.randn(1, K, device=device).to(dtype)
    norm_w = (0.5 * torch.randn(K, device=device)).to(dtype)
    w = weight(N, K, dtype, device)
    conv_w, pool = conv_operands(D, W, device, dtype)
    ref_pool = pool.clone()
    slots = (torch.tensor([src], dtype=torch.int32, device=device),
             torch.tensor([dst], dtype=torch.int32, device=device))
    if norm:
        out, total = add_rmsnorm_linear(x, residual, norm_w, EPS, w, (conv_w, pool, *slots))
        want, want_total = reference.add_rmsnorm_linear(x, residual, norm_w, EPS, w,
                                                        (conv_w, ref_pool, *slots))
        assert torch.equal(total, want_total)
    else:
        out = linear(x, w, (conv_w, pool, *slots))
        want = reference.linear(x, w, (conv_w, ref_pool, *slots))
    assert rel_err(out[:, :D], want[:, :D]) < TOL[dtype]
    assert rel_err(out[:, D:], want[:, D:]) < TOL[dtype]
    # the window's new input is the projection output rounded as stored: one ulp of it at most
    assert rel_err(pool, ref_pool) < TOL[dtype] and torch.equal(pool[0], ref_pool[0])
    others = [s for s in range(1, 4) if s != dst]
    assert torch.equal(pool[others], ref_pool[others])


def test_the_decode_conv_with_more_rows_takes_the_unfused_ops(device):
    N, K, D, W = 24, 64, 16, 4
    x, w = torch.randn(2, K, device=device), weight(N, K, torch.float32, device)
    conv_w, pool = conv_operands(D, W, device)
    ref_pool = pool.clone()
    src = torch.tensor([1, 2], dtype=torch.int32, device=device)
    dst = torch.tensor([3, 2], dtype=torch.int32, device=device)
    out = linear(x, w, (conv_w, pool, src, dst))
    want = reference.linear(x, w, (conv_w, ref_pool, src, dst))
    assert rel_err(out, want) < TOL[torch.float32] and rel_err(pool, ref_pool) < 1e-6


def test_bad_conv_operands_are_one_clear_error(device):
    x, w = torch.randn(1, 64, device=device), weight(24, 64, torch.float32, device)
    conv_w, pool = conv_operands(16, 4, device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="must be"):
        linear(x, w, (conv_w, pool, one))
    with pytest.raises(ValueError, match=r"D <= 24"):
        linear(x, w, (torch.randn(32, 4, device=device), pool, one, one))
    with pytest.raises(ValueError, match="conv1d shapes disagree"):
        linear(x, w, (conv_w, pool[:, :2], one, one))
    with pytest.raises(ValueError, match="int32"):
        linear(x, w, (conv_w, pool, one.long(), one))
    with pytest.raises(ValueError, match="dst slots"):
        add_rmsnorm_linear(x, x, torch.ones(64, device=device), EPS, w,
                           (conv_w, pool, one, torch.ones(2, dtype=torch.int32, device=device)))


def test_the_decode_conv_reads_the_projection_as_stored(device):
    """With w[n] = e_n + e_(n+N) the projection is exact in float32 and rounded at its store;
    the conv must see it rounded, as the unfused conv kernel reads it from memory."""
    dtype, N, D, W = torch.bfloat16, 48, 48, 4
    K = 2 * N
    eye = torch.eye(K, device=device)
    w = (eye[:N] + eye[N:]).to(dtype)
    x = (torch.randn(1, K, device=device) * 2).to(dtype)
    conv_w, pool = conv_operands(D, W, device, dtype)
    ref_pool = pool.clone()
    one = torch.ones(1, dtype=torch.int32, device=device)
    out = linear(x, w, (conv_w, pool, one, one))
    want = reference.linear(x, w, (conv_w, ref_pool, one, one))
    assert same_roundings(out, want) and torch.equal(pool, ref_pool)


@pytest.mark.parametrize("N,K,D", [(300, 1024, 150), (90, WHOLE_ROW + 404, 40)],
                         ids=["tiles-in-and-past-the-conv", "walked-rows"])
def test_the_decode_conv_on_every_tile_a_program_walks(device, N, K, D, monkeypatch):
    """One program per core walks many column tiles: those wholly inside the conv's columns,
    the one across its edge and those past it; rows wider than WHOLE_ROW are walked along K."""
    monkeypatch.setitem(gemv.CUDA_GEMV, "programs_per_core", 1)
    x, w = torch.randn(1, K, device=device), weight(N, K, torch.float32, device)
    residual, norm_w = torch.randn(1, K, device=device), 0.5 * torch.randn(K, device=device)
    conv_w, pool = conv_operands(D, 4, device)
    ref_pool = pool.clone()
    one = torch.ones(1, dtype=torch.int32, device=device)
    out, _ = add_rmsnorm_linear(x, residual, norm_w, EPS, w, (conv_w, pool, one, one))
    want, _ = reference.add_rmsnorm_linear(x, residual, norm_w, EPS, w,
                                          (conv_w, ref_pool, one, one))
    assert rel_err(out, want) < TOL[torch.float32] and rel_err(pool, ref_pool) < 1e-6


def test_the_kernel_serves_any_row_count_with_the_conv_and_the_gated_norm(device):
    """As test_the_kernel_serves_any_row_count: each row its own slots (one reads the null
    slot, one is updated in place), and the gated norm over several rows."""
    from kernels.gemv import _GATED_NORM, _launch

    M, N, K, D = 3, 40, 96, 24
    x, w = torch.randn(M, K, device=device), weight(N, K, torch.float32, device)
    conv_w, pool = conv_operands(D, 4, device)
    pool = torch.cat([pool, torch.randn(2, 3, D, device=device)])  # slots 0-5
    ref_pool = pool.clone()
    src = torch.tensor([2, 0, 5], dtype=torch.int32, device=device)
    dst = torch.tensor([2, 3, 4], dtype=torch.int32, device=device)
    out, _ = _launch(x, w, 0, K, conv=(conv_w, pool, src, dst))
    want = reference.linear(x, w, (conv_w, ref_pool, src, dst))
    assert rel_err(out, want) < TOL[torch.float32] and rel_err(pool, ref_pool) < 1e-6
    o, z = gdn_output(2, 4, 32, torch.float32, device)
    norm_w, w = 1 + 0.5 * torch.randn(32, device=device), weight(N, 128, torch.float32, device)
    out, _ = _launch(o.reshape(2, 128), w, _GATED_NORM, 128, z.reshape(2, 128), norm_w, EPS,
                     head_dim=32)
    assert rel_err(out, reference.gated_rmsnorm_linear(o, z, norm_w, EPS, w)) < TOL[torch.float32]


def test_a_norm_weight_of_another_dtype_still_runs(device):
    """The add+norm prologue loads its weight in any float dtype (the product dtype matters
    only to the gated norm)."""
    x, w = torch.randn(1, 64, device=device), weight(8, 64, torch.float32, device)
    norm_w = torch.randn(64, device=device, dtype=torch.float64)
    out, _ = add_rmsnorm_linear(x, x, norm_w, EPS, w)
    want, _ = reference.add_rmsnorm_linear(x, x, norm_w.float(), EPS, w)
    assert rel_err(out, want) < TOL[torch.float32]
