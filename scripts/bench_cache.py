"""State-cache benchmark on a GPU: time to first token after an edit, from each tier.

    python3 scripts/bench_cache.py [--models 1b,27b] [--lengths 8192,32768] [--root DIR]
                                   [--cold-runs N] [--evict all|cache-dir] [--warm-gpu S]

For each model (random weights, Qwen3.5 shapes: the ~1B model of bench_e2e.py, and
Qwen3.5-27B's layer shapes cut to 16 layers; `tiny` is the embedded model on the CPU) and
prompt length, a conversation of that length is run, then its last user message is edited, and
the edited request's time to first token is measured (a) cold, with no cache; (b) from the
device tier; (c) from the host tier (device tier dropped); (d) from disk after a restart with
the page cache warm; (e) the same with the page cache dropped; and (f) a prompt the cache has
never seen, with the cache on (the snapshots and queued writes of its first chunks overlap its
later ones; writes still running at the first token are not counted; median of --cold-runs). The
disk's own sequential read bandwidth (cold and warm) is measured in the same run, with the
restore's read bandwidth. The store decides between loading and recomputing, so every row should
be <= 1.05 x (a). Every measured request follows --warm-gpu seconds of GPU work, so none starts
from idle clocks. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch
from bench_common import add_tokenizer
from bench_common import ids as random_ids
from bench_common import ttft_out as ttft

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL

SHAPES = {
    "1b": {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
           "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_key_heads": 16,
           "linear_num_value_heads": 16},
    "tiny": {},  # the embedded tiny model on the CPU (scripts/make_tiny_model.py)
    "27b": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 16,
            "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48},
}
ROWS: list[str] = []


def build(name: str, out: Path) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=248320, head_dim=256, linear_key_head_dim=128,
                            linear_value_head_dim=128, max_position_embeddings=65536,
                            tie_word_embeddings=False, **SHAPES[name],
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    add_tokenizer(out)


def drop_page_cache(folder: Path, everything: bool = True) -> None:
    """Evict the page cache: all of it (drop_caches, when allowed), or only the folder's files
    (posix_fadvise). Dropping everything also evicts the process's own libraries and compiled
    kernels, whose reloading a measured request then pays; `--evict cache-dir` avoids that."""
    os.sync()
    if everything:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        except OSError:
            pass
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            libc.posix_fadvise(fd, 0, 0, 4)  # POSIX_FADV_DONTNEED
            os.close(fd)


def disk_bandwidth(folder: Path) -> tuple[float, float]:
    """Sequential read of a 2 GiB file: (cold, page-cache warm) bytes per second."""
    f = folder / "bw.bin"
    with open(f, "wb") as fh:
        block = os.urandom(1 << 20)
        fh.writelines(block for _ in range(2048))
    rates = []
    for drop in (True, False):
        if drop:
            drop_page_cache(folder)
        t = time.perf_counter()
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
        rates.append(f.stat().st_size / (time.perf_counter() - t))
    f.unlink()
    return rates[0], rates[1]


WARM_GPU_S = 0.2  # --warm-gpu: GPU work before each measured request (0: none)


def warm_gpu(seconds: float) -> None:
    """Keep the GPU busy for `seconds` so that every measured request starts at the same clocks.
    An idle H100 drops to 345 MHz, and some rows follow idle time (a flush of the write-behind,
    an engine's start, which pins the host tier) while others follow work; on the small model
    that difference alone moved single samples by tens of percent."""
    if seconds <= 0 or not torch.cuda.is_available():
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def measured(engine: LLMEngine, prompt: list[int]):
    """ttft_out after collecting the engines deleted so far (a real restart starts a fresh
    process, so their freeing, a gen-2 collection of caches and host-tier buffers, 0.2 s on the
    CPU, must not land inside the measured request) and after WARM_GPU_S of GPU work."""
    gc.collect()
    warm_gpu(WARM_GPU_S)
    return ttft(engine, prompt)


def engine_for(path: Path, loaded, cache_dir: Path | None, n: int) -> LLMEngine:
    cfg = EngineConfig(model=path, device=str(loaded.device.type), cache_dir=cache_dir,
                       enable_prefix_cache=cache_dir is not None,
                       memory_fraction=0.2, max_num_seqs=8,
                       max_model_len=min(n + 2048, loaded.config.max_position_embeddings),
                       disk_cache_bytes=64 << 30, host_cache_bytes=4 << 30)
    return LLMEngine(cfg, loaded=loaded)


def bench(name: str, n: int, root: Path, disk_bw: tuple[float, float], cold_runs: int = 1,
          evict_all: bool = True) -> None:
    if name == "tiny":  # the embedded model, on the CPU
        path, device, dtype, vocab = EMBEDDED_MODEL, "cpu", torch.float32, 380
    else:
        path, device, dtype, vocab = root / f"model-{name}", "cuda", torch.bfloat16, 248000
        if not path.exists():
            build(name, path)
    loaded = load_model(path, dtype=dtype, device=device)
    ids = partial(random_ids, vocab=vocab)
    convo = ids(n, 1)
    edited = convo[: n - 40] + ids(60, 2)
    cold = engine_for(path, loaded, None, n)  # kept: (a) is sampled between the other rows too
    ttft(cold, ids(len(edited), 3))  # compile at the measured length
    cold_times = [measured(cold, edited)[0] for _ in range(cold_runs)]
    cache_dir = root / f"cache-{name}-{n}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    warm = engine_for(path, loaded, cache_dir, n)
    warm.generate([convo], SamplingParams(max_tokens=8, ignore_eos=True))
    warm.store.flush()
    t_b, out_b = measured(warm, edited)
    warm.drop_device_cache()
    warm.store.flush()  # (b)'s own saves are written before (c), as between a user's turns
    t_c, out_c = measured(warm, edited)
    fresh = []  # (f) a prompt the cache has never seen, with the cache on: what saving costs it
    for i in range(max(cold_runs, 1)):
        fresh.append(measured(warm, ids(len(edited), 50 + i))[0])
        warm.store.flush()
    warm.close()
    del warm
    cold_times.append(measured(cold, edited)[0])
    results = {}
    for label, drop in (("d", False), ("e", True)):
        if drop:
            drop_page_cache(cache_dir, evict_all)
        restarted = engine_for(path, loaded, cache_dir, n)
        ttft(restarted, ids(len(edited), 4 if drop else 5))  # warm up like (a): no cache hit
        restarted.store.flush()  # its write-behind must not compete with the measured request
        if drop:
            drop_page_cache(cache_dir, evict_all)
        results[label] = measured(restarted, edited)
        restarted.close()
        del restarted
        cold_times.append(measured(cold, edited)[0])
    del cold
    (t_d, out_d), (t_e, out_e) = results["d"], results["e"]
    t_a = sorted(cold_times)[len(cold_times) // 2]  # the median, over samples taken throughout
    samples = [round(t * 1e3, 1) for t in cold_times]
    print(f"{name} {n // 1024}k (a) samples {samples} ms", flush=True)

    def cell(t, out) -> str:
        plan = out.cache_plan or {}
        return (f"{t * 1e3:.1f} ({t / t_a:.2f}x; {out.reused_from or 'none'}, "
                f"{plan.get('choice', '-')})")

    def bandwidth(out) -> str:
        plan = out.cache_plan or {}
        return f"{plan['loaded_bytes'] / plan['load_s'] / 1e9:.2f}" if plan.get("load_s") else "-"

    for label, (t, out) in (("b", (t_b, out_b)), ("c", (t_c, out_c)), ("d", (t_d, out_d)),
                            ("e", (t_e, out_e))):
        print(f"{name} {n // 1024}k ({label}) {t * 1e3:.1f} ms, plan {out.cache_plan}", flush=True)
    restore_bw = f"(d) {bandwidth(out_d)} / (e) {bandwidth(out_e)} GB/s"
    t_f = sorted(fresh)[len(fresh) // 2]
    ROWS.append(f"| {name} | {n // 1024}k | {t_a * 1e3:.1f} | {cell(t_b, out_b)} | "
                f"{cell(t_c, out_c)} | {cell(t_d, out_d)} | {cell(t_e, out_e)} | "
                f"{restore_bw} (disk {disk_bw[0] / 1e9:.2f} cold / "
                f"{disk_bw[1] / 1e9:.2f} warm GB/s) | {t_f * 1e3:.1f} ({t_f / t_a:.2f}x) |")
    print(ROWS[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="1b,27b")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--root", default="/tmp/statechat-cache-bench")
    ap.add_argument("--cold-runs", type=int, default=1,
                    help="(a): the median of this many first samples and one after each of "
                         "(c), (d), (e)")
    ap.add_argument("--evict", choices=("all", "cache-dir"), default="all",
                    help="what (e) evicts from the page cache")
    ap.add_argument("--warm-gpu", type=float, default=0.2,
                    help="seconds of GPU work before each measured request, so every sample "
                         "starts at the same clocks (0: none, as runs before 2026-11-22 evening)")
    args = ap.parse_args()
    global WARM_GPU_S
    WARM_GPU_S = args.warm_gpu
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", flush=True)
    bw = disk_bandwidth(root)
    print(f"disk sequential read: {bw[0] / 1e9:.2f} GB/s cold, {bw[1] / 1e9:.2f} GB/s warm",
          flush=True)
    for name in args.models.split(","):
        for n in (int(x) for x in args.lengths.split(",")):
            try:
                bench(name, n, root, bw, args.cold_runs, args.evict == "all")
            except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
                ROWS.append(f"| {name} | {n // 1024}k | error: {type(e).__name__}: "
                            f"{str(e)[:120]} |")
                print(ROWS[-1], flush=True)
    print("\n| model | tokens | (a) cold ms | (b) device | (c) host | (d) disk, warm page cache | "
          "(e) disk, cold page cache | restore read bandwidth | (f) fresh prompt, cache on |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(ROWS))


if __name__ == "__main__":
    main()
