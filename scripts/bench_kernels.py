"""Benchmark statechat's Triton kernels on one GPU against the usual baselines.

Usage (FLA wheels on PYTHONPATH for the GDN prefill comparison):
    python3 scripts/bench_kernels.py [--deadline SECONDS] [--plan gdn_decode,attention,...]
                                     [--out results.json] [--smoke]

Sections (each guarded: a failure becomes an error row and the next section runs):
- gdn_prefill: chunk_gdn vs FLA's chunk_gated_delta_rule, one sequence, H=16, K=V=128, bf16,
  T in {4096, 16384}, HV in {16, 32, 48}, same data and initial state (FLA gets g and beta
  precomputed outside the timed call); per-kernel times from the torch profiler.
- gdn_decode: recurrent_gdn at HV=32, K=V=128, N in {1, 16, 64, 256} sequences, timed with and
  without CUDA graphs, against a device-to-device copy of the same fp32 state bytes (read +
  write) timed in the same run.
- attention: paged_attention vs torch SDPA (enable_gqa) on the same data, Hq=8, Hkv=2, D=256,
  bf16, 64-token blocks in shuffled order: prefill T=8192, decode batch 1 and 32 at 8192.
- checkpoints: chunk_gdn at T=16384 with no checkpoint vs one per 64-token block.
- state_variants (only with time left): launch variants of the GDN state kernel at T=16384.

The deadline (seconds from start) is checked before each case; a case that has started runs
to its end. Results go to --out (JSON, rewritten after every section) and a markdown summary
is printed last. --smoke runs tiny shapes on the CPU (Triton interpreter) to test this script.
"""

# ruff: noqa: B023, BLE001, C408  (closures run in their loop iteration; sections catch all)
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

T_START = time.time()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Bench:
    """Run-wide settings: device, shapes (full or smoke), deadline, and the results so far."""

    def __init__(self, smoke: bool, deadline: float, out: str):
        self.smoke = smoke
        self.dev = "cpu" if smoke else "cuda"
        self.deadline = deadline
        self.out = out
        self.results: dict = {"meta": {}, "errors": []}

    def time_left(self) -> bool:
        return time.time() - T_START < self.deadline

    def ms(self, fn: Callable, graph: bool = False) -> float:
        """Mean milliseconds per call: triton's do_bench (L2 flushed) or CUDA-graph replay."""
        if self.smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        from triton.testing import do_bench, do_bench_cudagraph

        return do_bench_cudagraph(fn) if graph else do_bench(fn, warmup=25, rep=100)

    def save(self) -> None:
        with open(self.out, "w") as f:
            json.dump(self.results, f, indent=1)


def log(*args) -> None:
    print(f"[{time.time() - T_START:6.1f}s]", *args, flush=True)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()


def kernel_ms(B: Bench, fn: Callable, reps: int = 3) -> dict[str, float]:
    """Device milliseconds per call of each kernel fn launches (torch profiler), largest first."""
    if B.smoke:
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
    except Exception as e:  # no CUPTI: timings without the split
        log("profiler failed:", repr(e)[:200])
        return {}
    times: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            times[e.key[:48]] = times.get(e.key[:48], 0.0) + us / reps / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:12])


# ---------------------------------------------------------------- GDN prefill


def gdn_inputs(B: Bench, T: int, HV: int, num_slots: int, H: int = 16, K: int = 128):
    """Random prefill inputs (bf16, or fp32 in smoke mode) and a state pool."""
    dt = torch.float32 if B.smoke else torch.bfloat16
    d = B.dev
    inp = {
        "q": torch.randn(T, H, K, dtype=dt, device=d),
        "k": torch.randn(T, H, K, dtype=dt, device=d),
        "v": torch.randn(T, HV, K, dtype=dt, device=d),
        "a": torch.randn(T, HV, dtype=dt, device=d),
        "b": torch.randn(T, HV, dtype=dt, device=d),
        "A_log": torch.rand(HV, device=d) * 2 - 1.5,
        "dt_bias": torch.randn(HV, device=d),
    }
    return inp, torch.randn(num_slots, HV, K, K, device=d) * 0.1


def ours_prefill(B: Bench, inp: dict, pool: torch.Tensor, ckpt=None) -> Callable:
    """chunk_gdn over one sequence, reading slot 1, writing slot 2 (and checkpoints)."""
    from kernels import gdn_chunk

    T = inp["q"].shape[0]
    cu = torch.tensor([0, T], dtype=torch.int32, device=B.dev)
    src = torch.tensor([1], dtype=torch.int32, device=B.dev)
    dst = torch.tensor([2], dtype=torch.int32, device=B.dev)
    return lambda: gdn_chunk.chunk_gdn(
        **inp, state_pool=pool, cu_seqlens=cu, src_slots=src, dst_slots=dst, checkpoints=ckpt
    )


def fla_prefill(inp: dict, pool: torch.Tensor) -> Callable:
    """FLA's chunk_gated_delta_rule on the same data; returns (o, final state)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = (-inp["A_log"].exp() * F.softplus(inp["a"].float() + inp["dt_bias"]))[None]
    beta = inp["b"].float().sigmoid().to(inp["v"].dtype)[None]
    h0 = pool[1:2].clone()
    q, k, v = inp["q"][None], inp["k"][None], inp["v"][None]
    return lambda: chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def _split(times: dict[str, float]) -> dict[str, float]:
    """prepare/state/output ms of our three GDN kernels (the rest summed as other_ms)."""
    out = {"prepare_ms": 0.0, "state_ms": 0.0, "output_ms": 0.0, "other_ms": 0.0}
    for name, ms in times.items():
        key = next((f"{p}_ms" for p in ("prepare", "state", "output") if f"gdn_{p}" in name), None)
        out[key or "other_ms"] += ms
    return out


def gdn_prefill(B: Bench) -> list[dict]:
    rows = []
    cases = (
        [(16, 2), (16, 64)] if B.smoke else [(HV, T) for HV in (16, 32, 48) for T in (4096, 16384)]
    )
    for HV, T in cases:
        if not B.time_left():
            rows.append(dict(HV=HV, T=T, skipped="deadline"))
            continue
        inp, pool = gdn_inputs(B, T, HV, 3, H=2 if B.smoke else 16, K=16 if B.smoke else 128)
        ours = ours_prefill(B, inp, pool)
        o = ours()
        row = dict(HV=HV, T=T, ours_ms=B.ms(ours), **_split(kernel_ms(B, ours)))
        if not B.smoke:
            try:  # FLA missing or failing must not hide our numbers
                fla = fla_prefill(inp, pool)
                o_fla, ht_fla = fla()
                row.update(fla_ms=B.ms(fla), err_o=rel(o, o_fla), err_state=rel(pool[2], ht_fla[0]))
                row["ratio"] = row["ours_ms"] / row["fla_ms"]
                row["fla_kernels_ms"] = kernel_ms(B, fla)
            except Exception as e:
                row["fla_error"] = repr(e)[:300]
        log("gdn_prefill", row)
        rows.append(row)
        del inp, pool, ours, o
        if not B.smoke:
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- GDN decode


def gdn_decode(B: Bench) -> list[dict]:
    from kernels.gdn_recurrent import recurrent_gdn

    rows = []
    H, HV, K = (2, 4, 16) if B.smoke else (16, 32, 128)
    dt = torch.float32 if B.smoke else torch.bfloat16
    for N in (1, 16, 64, 256):
        if not B.time_left():
            rows.append(dict(N=N, skipped="deadline"))
            continue
        d = B.dev
        q, k = (torch.randn(N, H, K, dtype=dt, device=d) for _ in range(2))
        v = torch.randn(N, HV, K, dtype=dt, device=d)
        a, b = (torch.randn(N, HV, dtype=dt, device=d) for _ in range(2))
        A_log, dt_bias = torch.rand(HV, device=d) - 1, torch.randn(HV, device=d)
        pool = torch.randn(2 * N + 1, HV, K, K, device=d) * 0.1
        # read one set of slots, write another: back to back, a call reads its state while the
        # one before may still write (PDL; in a decode step the in-projection comes between)
        src = torch.arange(1, N + 1, dtype=torch.int32, device=d)
        dst = src + N
        fn = lambda: recurrent_gdn(q, k, v, a, b, A_log, dt_bias, pool, src, dst)
        x = torch.randn(N * HV * K * K, device=d)
        y = torch.empty_like(x)
        nbytes = 2 * x.numel() * 4  # state read + write
        t_copy = B.ms(lambda: y.copy_(x), graph=True)
        t_graph = B.ms(fn, graph=True)
        row = dict(
            N=N,
            graph_us=t_graph * 1e3,
            plain_us=B.ms(fn) * 1e3,
            copy_us=t_copy * 1e3,
            GBps=nbytes / t_graph / 1e6,
            copy_GBps=nbytes / t_copy / 1e6,
            frac_of_copy=t_copy / t_graph,
        )
        log("gdn_decode", row)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- paged attention


def paged_kv(B: Bench, kv_len: int, batch: int, Hkv: int, D: int, block: int = 64):
    """k, v [batch, kv_len, Hkv, D] and the same data in shuffled blocks + block tables."""
    dt = torch.float32 if B.smoke else torch.bfloat16
    nb = (kv_len + block - 1) // block
    k = torch.randn(batch, nb * block, Hkv, D, device=B.dev, dtype=dt)
    v = torch.randn_like(k)
    perm = torch.randperm(batch * nb, device=B.dev)
    kc = torch.empty(batch * nb, block, Hkv, D, device=B.dev, dtype=dt)
    vc = torch.empty_like(kc)
    kc[perm] = k.view(batch * nb, block, Hkv, D)
    vc[perm] = v.view(batch * nb, block, Hkv, D)
    return k[:, :kv_len], v[:, :kv_len], kc, vc, perm.view(batch, nb).int()


def _attn_row(B: Bench, case: str, ours: Callable, sdpa: Callable, out_of: Callable, work: dict):
    o, ref = ours(), out_of(sdpa())
    t_ours, t_sdpa = B.ms(ours), B.ms(sdpa)
    row = dict(case=case, ours_us=t_ours * 1e3, sdpa_us=t_sdpa * 1e3, ratio=t_ours / t_sdpa)
    if "flops" in work:
        row["ours_TFLOPs"] = work["flops"] / t_ours / 1e9
    else:
        row["ours_GBps"] = work["bytes"] / t_ours / 1e6
    row["err_vs_sdpa"] = rel(o, ref)
    log("attention", row)
    return row


def attention(B: Bench) -> list[dict]:
    from kernels.attention import paged_attention

    Hq, Hkv, D = (4, 2, 16) if B.smoke else (8, 2, 256)
    ctx_len = 192 if B.smoke else 8192
    scale = D**-0.5
    rows = []
    # prefill: one sequence of ctx_len new tokens, causal
    k, v, kc, vc, bt = paged_kv(B, ctx_len, 1, Hkv, D)
    q = torch.randn(ctx_len, Hq, D, device=B.dev, dtype=k.dtype)
    cu = torch.tensor([0, ctx_len], dtype=torch.int32, device=B.dev)
    ctx = torch.tensor([ctx_len], dtype=torch.int32, device=B.dev)
    qs, ks, vs = q.transpose(0, 1)[None], k.transpose(1, 2), v.transpose(1, 2)
    rows.append(
        _attn_row(
            B,
            f"prefill T={ctx_len}",
            lambda: paged_attention(q, kc, vc, bt, cu, ctx, scale),
            lambda: F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            ),
            lambda o: o[0].transpose(0, 1),
            dict(flops=2 * ctx_len * ctx_len * D * Hq),  # causal: half of 4 T^2 D Hq
        )
    )
    for batch in (1, 32):
        if not B.time_left():
            rows.append(dict(case=f"decode B={batch}", skipped="deadline"))
            continue
        k, v, kc, vc, bt = paged_kv(B, ctx_len, batch, Hkv, D)
        q = torch.randn(batch, Hq, D, device=B.dev, dtype=k.dtype)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=B.dev)
        ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device=B.dev)
        qs, ks, vs = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
        rows.append(
            _attn_row(
                B,
                f"decode B={batch} ctx={ctx_len}",
                lambda: paged_attention(q, kc, vc, bt, cu, ctx, scale),
                lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True),
                lambda o: o[:, :, 0],
                dict(bytes=2 * batch * ctx_len * Hkv * D * k.element_size()),
            )
        )
    return rows


# ---------------------------------------------------------------- checkpoint export


def checkpoints(B: Bench) -> list[dict]:
    from kernels.reference import Checkpoints

    rows = []
    T = 128 if B.smoke else 16384
    for HV in (16, 32):
        if not B.time_left():
            rows.append(dict(HV=HV, T=T, skipped="deadline"))
            continue
        n = T // 64
        kw = dict(H=2, K=16) if B.smoke else {}
        inp, pool = gdn_inputs(B, T, HV, n + 3, **kw)
        ckpt = Checkpoints(
            seq=torch.zeros(n, dtype=torch.int32, device=B.dev),
            boundary=torch.arange(64, T + 1, 64, dtype=torch.int32, device=B.dev),
            slot=torch.arange(3, n + 3, dtype=torch.int32, device=B.dev),
        )
        t0 = B.ms(ours_prefill(B, inp, pool))
        t1 = B.ms(ours_prefill(B, inp, pool, ckpt))
        ckpt_bytes = n * pool[0].numel() * 4
        row = dict(
            HV=HV, T=T, no_ckpt_ms=t0, ckpt_every_block_ms=t1, overhead_pct=100 * (t1 / t0 - 1)
        )
        row["ckpt_GB"] = ckpt_bytes / 1e9
        log("checkpoints", row)
        rows.append(row)
        del inp, pool
    return rows


# ---------------------------------------------------------------- state kernel variants


def state_variants(B: Bench) -> list[dict]:
    """The GDN state kernel's launch config varied at T=16384 (others at default)."""
    from kernels import gdn_chunk

    rows = []
    T = 128 if B.smoke else 16384
    variants = [
        dict(BV=64, num_warps=8, num_stages=2),
        dict(BV=64, num_warps=4, num_stages=3),
        dict(BV=16, num_warps=4, num_stages=3),
        dict(BV=32, num_warps=8, num_stages=3),
    ]
    default = dict(gdn_chunk.CONFIG["state"])
    for HV in (48, 32):
        inp, pool = gdn_inputs(B, T, HV, 3, **(dict(H=2, K=16) if B.smoke else {}))
        fn = ours_prefill(B, inp, pool)
        o_ref, h_ref = fn().clone(), pool[2].clone()
        # a variant fixes the tile (wide_BV = BV); the default chooses it from the grid
        for cfg in [default, *({**default, **v, "wide_BV": v["BV"]} for v in variants)]:
            if not B.time_left():
                break
            gdn_chunk.CONFIG["state"] = cfg
            try:
                err = max(rel(fn(), o_ref), rel(pool[2], h_ref))
                row = dict(HV=HV, T=T, **cfg, total_ms=B.ms(fn), err_vs_default=err)
                if cfg is default:
                    row["BV"] = f"{cfg['BV']}/{cfg['wide_BV']} by grid"
                row["state_ms"] = _split(kernel_ms(B, fn))["state_ms"]
            except Exception as e:  # a config may not fit (registers, shared memory)
                row = dict(HV=HV, T=T, **cfg, error=repr(e)[:200])
            finally:
                gdn_chunk.CONFIG["state"] = default
            log("state_variants", row)
            rows.append(row)
    return rows


SECTIONS = {  # default order: cheap and never-measured sections first, FLA autotuning later
    "gdn_decode": gdn_decode,
    "attention": attention,
    "gdn_prefill": gdn_prefill,
    "checkpoints": checkpoints,
    "state_variants": state_variants,
}


# ---------------------------------------------------------------- summary


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _gpu_ratio(r: dict) -> str:
    """Kernel-time ratio from the profiler (host launch time excluded), e.g. "1.23 (1.10/0.89)"."""
    ours = sum(r.get(k, 0.0) for k in ("prepare_ms", "state_ms", "output_ms", "other_ms"))
    fla = sum(r.get("fla_kernels_ms", {}).values())
    return f"{ours / fla:.2f} ({ours:.2f}/{fla:.2f})" if ours and fla else "-"


def summary(res: dict) -> str:
    """Markdown tables of every section that produced rows; skipped cases and errors listed."""
    out, skipped = [], []
    ok = lambda name: [r for r in res.get(name, []) if "skipped" not in r and "error" not in r]
    for name, rows in res.items():
        if isinstance(rows, list):
            skipped += [f"{name} {r}" for r in rows if "skipped" in r or "error" in r]
    if rows := ok("gdn_prefill"):
        out += ["GDN prefill (H=16, K=V=128, bf16, one sequence), ms; GPU = profiled kernel time"]
        out += _table(
            ["HV", "T", "ours", "FLA", "ours/FLA", "GPU ours/FLA", "prep/state/out", "err o/state"],
            [
                [
                    str(r["HV"]),
                    str(r["T"]),
                    _fmt(r["ours_ms"], ".3f"),
                    _fmt(r.get("fla_ms"), ".3f"),
                    _fmt(r.get("ratio")),
                    _gpu_ratio(r),
                    "/".join(_fmt(r[k], ".2f") for k in ("prepare_ms", "state_ms", "output_ms")),
                    f"{_fmt(r.get('err_o'), '.1e')}/{_fmt(r.get('err_state'), '.1e')}",
                ]
                for r in rows
            ],
        ) + [""]
    if rows := ok("gdn_decode"):
        out += ["GDN decode (HV=32, K=V=128, fp32 state read+write)"]
        out += _table(
            ["N", "graph us", "plain us", "GB/s", "copy GB/s", "of copy"],
            [
                [
                    str(r["N"]),
                    _fmt(r["graph_us"], ".1f"),
                    _fmt(r["plain_us"], ".1f"),
                    _fmt(r["GBps"], ".0f"),
                    _fmt(r["copy_GBps"], ".0f"),
                    _fmt(r["frac_of_copy"]),
                ]
                for r in rows
            ],
        ) + [""]
    if rows := ok("attention"):
        out += ["Paged attention vs SDPA (enable_gqa), Hq=8 Hkv=2 D=256 bf16"]
        out += _table(
            ["case", "ours us", "SDPA us", "ours/SDPA", "ours rate", "rel err"],
            [
                [
                    r["case"],
                    _fmt(r["ours_us"], ".1f"),
                    _fmt(r["sdpa_us"], ".1f"),
                    _fmt(r["ratio"]),
                    f"{r['ours_TFLOPs']:.0f} TFLOP/s"
                    if "ours_TFLOPs" in r
                    else f"{r['ours_GBps']:.0f} GB/s",
                    _fmt(r["err_vs_sdpa"], ".1e"),
                ]
                for r in rows
            ],
        ) + [""]
    if rows := ok("checkpoints"):
        out += ["Checkpoint export (chunk_gdn, one checkpoint per 64-token block), ms"]
        out += _table(
            ["HV", "T", "no ckpt", "every block", "overhead %", "ckpt GB"],
            [
                [
                    str(r["HV"]),
                    str(r["T"]),
                    _fmt(r["no_ckpt_ms"], ".3f"),
                    _fmt(r["ckpt_every_block_ms"], ".3f"),
                    _fmt(r["overhead_pct"], ".1f"),
                    _fmt(r["ckpt_GB"], ".2f"),
                ]
                for r in rows
            ],
        ) + [""]
    if rows := ok("state_variants"):
        out += ["GDN state kernel variants, T=16384 (first row per HV = default), ms"]
        out += _table(
            ["HV", "BV", "warps", "stages", "total", "state", "err vs default"],
            [
                [
                    str(r["HV"]),
                    str(r["BV"]),
                    str(r["num_warps"]),
                    str(r["num_stages"]),
                    _fmt(r["total_ms"], ".3f"),
                    _fmt(r.get("state_ms"), ".3f"),
                    _fmt(r["err_vs_default"], ".1e"),
                ]
                for r in rows
            ],
        ) + [""]
    out += [f"skipped/failed: {s}"[:300] for s in skipped]
    out += [f"error: {e['section']}: {e['error']}"[:300] for e in res.get("errors", [])]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds from start")
    parser.add_argument("--plan", default=",".join(SECTIONS), help="sections, in order")
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json")
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    B = Bench(args.smoke, args.deadline, args.out)
    torch.manual_seed(0)
    import triton

    from kernels import attention as attn
    from kernels import gdn_chunk, gdn_recurrent

    B.results["meta"] = dict(
        device=torch.cuda.get_device_name() if not args.smoke else "cpu (interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        gdn_chunk=gdn_chunk.CONFIG,
        gdn_recurrent=gdn_recurrent.CONFIG,
        attn_prefill=attn.CUDA_PREFILL,
        attn_prefill_small_tiles_on=[str(d) for d in attn._TOO_LARGE],  # filled as runs fall back
        attn_decode=attn.CUDA_DECODE,
        argv=sys.argv,
    )
    log(B.results["meta"])
    for name in args.plan.split(","):
        try:
            B.results[name] = SECTIONS[name](B)
        except Exception as e:
            log(f"{name} failed:\n{traceback.format_exc()}")
            B.results["errors"].append(dict(section=name, error=f"{type(e).__name__}: {e}"[:300]))
        B.results["meta"]["elapsed_s"] = time.time() - T_START
        B.save()
        if not args.smoke:
            torch.cuda.empty_cache()
    print("\n" + summary(B.results), flush=True)


if __name__ == "__main__":
    main()
