"""The last layer past its token mixer runs on the logits rows alone (Context.logits_seqs): the
logits of those rows, and every cache the step writes, equal those of a step that runs every
row through the whole model. Packed steps of several sequences, some without a logits row;
a step with none at all (a chunk in mid-prompt); a dense, a MoE and a GDN-last model; the
reference and the Triton kernels (the interpreter on the CPU)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels
from statechat.model.context import Context, ModelCaches
from statechat.model.loader import load_model
from statechat.model.qwen3_5 import Qwen3_5ForCausalLM
from tests.helpers import BLOCK, make_tiny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (70, 5, 130)  # tokens of each packed sequence, from a zero state


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory):
    dense = load_model(tiny_dirs["qwen3_5"], dtype=torch.float32, device=DEVICE)
    moe_dir = make_tiny(tmp_path_factory.mktemp("moe"), dtype="float32", moe=True)
    moe = load_model(moe_dir, dtype=torch.float32, device=DEVICE)
    # the dense model with its last layer a GDN layer (random weights, as the others')
    types = dense.config.layer_types[:-1] + ("linear_attention",)
    config = dataclasses.replace(dense.config, layer_types=types)
    torch.manual_seed(0)
    gdn_last = Qwen3_5ForCausalLM(config).to(DEVICE)
    with torch.no_grad():
        for name, p in gdn_last.named_parameters():
            if p.ndim == 1 and "A_log" not in name:  # norms: not their trivial init
                p.copy_(torch.randn(p.shape) * 0.1 + ("linear_attn.norm" in name))
    gdn_last.fuse_projections()
    return {"dense": (dense.model, dense.config), "moe": (moe.model, moe.config),
            "gdn_last": (gdn_last.eval(), config)}


def step(model, config, ids: list[list[int]], wanted: list[int], picked: bool):
    """One packed prefill of `ids` (one list per sequence, each from the zero state into slot
    i + 1, KV blocks in order) with the logits of the last rows of the sequences `wanted`:
    (logits, caches)."""
    dev, i32, i64 = DEVICE, torch.int32, torch.int64
    blocks = [-(-len(s) // BLOCK) for s in ids]
    caches = ModelCaches.allocate(config, len(ids) + 1, sum(blocks), BLOCK, torch.float32, dev)
    cu, tables, slots, first = [0], [], [], 0
    for s, n in zip(ids, blocks):
        cu.append(cu[-1] + len(s))
        tables.append(list(range(first, first + n)) + [0] * (max(blocks) - n))
        slots += [first * BLOCK + p for p in range(len(s))]
        first += n
    ctx = Context(
        positions=torch.tensor([p for s in ids for p in range(len(s))], dtype=i64, device=dev),
        cu_seqlens=torch.tensor(cu, dtype=i32, device=dev), is_decode=False,
        state_src=torch.zeros(len(ids), dtype=i32, device=dev),
        state_dst=torch.arange(1, len(ids) + 1, dtype=i32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=i64, device=dev),
        block_tables=torch.tensor(tables, dtype=i32, device=dev),
        context_lens=torch.tensor([len(s) for s in ids], dtype=i32, device=dev),
        logits_indices=torch.tensor([cu[i + 1] - 1 for i in wanted], dtype=i64, device=dev),
        logits_seqs=torch.tensor(wanted, dtype=i64, device=dev) if picked else None,
    )
    flat = torch.tensor([t for s in ids for t in s], device=dev)
    return model(flat, ctx, caches).cpu(), caches


CASES = [(name, wanted, "reference") for name in ("dense", "moe", "gdn_last")
         for wanted in ([0, 1, 2], [0, 2], [1], [])]
# the Triton kernels: every case on a GPU; on the CPU's interpreter (some 20 s a case) the one
# whose attention takes the picked rows' form (two of three sequences, one query each)
CASES += [case[:2] + ("triton",) for case in CASES
          if torch.cuda.is_available() or case[:2] == ("dense", [0, 2])]


@pytest.mark.parametrize(("name", "wanted", "backend"), CASES)
def test_logits_rows_alone_change_nothing(models, name, wanted, backend):
    model, config = models[name]
    gen = torch.Generator().manual_seed(len(wanted))
    ids = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    previous = kernels.get_backend()
    try:
        kernels.set_backend(backend)
        want, want_caches = step(model, config, ids, wanted, picked=False)
        got, got_caches = step(model, config, ids, wanted, picked=True)
    finally:
        kernels.set_backend(previous)
    assert got.shape == want.shape == (len(wanted), config.vocab_size)
    if wanted:
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-5, err
    for field in ("k", "v", "conv", "ssm"):  # every row's keys, values and states all the same
        for a, b in zip(getattr(got_caches, field), getattr(want_caches, field)):
            assert torch.equal(a, b), field


def test_the_engine_picks_the_rows_of_its_prefill_steps(tiny_dirs):
    """The engine's steps with prompt tokens pick their logits rows (the sequences that sample,
    in order; none for a chunk in mid-prompt), beside a decode that shares the step; decode
    steps and a step that scores its prompt run every row."""
    from statechat.engine.sampling import SamplingParams
    from tests.helpers import cpu_engine, random_prompts

    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)
    eng = cpu_engine(loaded, max_num_batched_tokens=128, enable_prefix_cache=False)
    seen, prepare = [], eng.runner.prepare

    def recording(batch, every_row=False):
        ids, ctx = prepare(batch, every_row)
        picked = None if ctx.logits_seqs is None else ctx.logits_seqs.tolist()
        seen.append((batch.is_decode, every_row, picked,
                     [i for i, it in enumerate(batch.items) if it.needs_logits]))
        return ids, ctx

    eng.runner.prepare = recording
    short, long = random_prompts(20, 300)
    eng.generate([long], SamplingParams(max_tokens=1))  # alone: chunks in mid-prompt
    eng.add_request(short, SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()  # the short prompt's whole prefill: it samples
    eng.add_request(long, SamplingParams(max_tokens=2, ignore_eos=True))  # beside its decode
    eng.add_request(short, SamplingParams(max_tokens=1, prompt_logprobs=1))
    while eng.has_unfinished():
        eng.step()
    prefills = [s for s in seen if not s[0] and not s[1]]
    assert prefills and all(picked == wanted for _, _, picked, wanted in prefills)
    assert [] in [picked for *_, picked, _ in prefills]  # a chunk in mid-prompt samples nothing
    assert any(len(wanted) > 1 for *_, wanted in prefills)  # a decode beside a chunk
    assert all(picked is None for decode, every_row, picked, _ in seen if decode or every_row)
    assert any(every_row for _, every_row, _, _ in seen)  # the scored prompt's step
