"""Structured outputs: greedy tokens under a JSON schema, a regex, a choice or a grammar equal
transformers' greedy `generate` with a logits processor that masks the same matcher's tokens,
for requests batched with plain ones, with chunked prefill, preemption and async scheduling
(the step after a structured row's is queued ahead, its sampling once the row's token is read:
the next mask needs it), and again from the prefix cache. Each reply holds to its constraint
(it parses, matches, is a choice), sampled ones too; `after_token` leaves the reply free until
that token; a bad constraint is refused in one line when the params are made."""

from __future__ import annotations

import json
import re

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.engine.structured import StructuredOutput
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.engine.test_engine_parity import count_continuations
from tests.engine.test_penalties import engine  # (an engine on a module's setup)

LENGTHS = [9, 75, 140]
NEW = 24
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # (compact: a tiny random model's
# greedy reply would otherwise fill its whitespace to max_tokens)
REGEX = "[0-9]{2}-[a-c]{3}"
CHOICES = ("alpha", "beta", "gamma delta")
CONSTRAINTS = [StructuredOutput(json=SCHEMA), StructuredOutput(regex=REGEX),
               StructuredOutput(choice=CHOICES)]


def holds(text: str, s: StructuredOutput) -> bool:
    """Whether a whole reply's text meets its constraint."""
    if s.kind == "json":
        value = json.loads(text)
        return set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue")
    if s.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def setup(tiny_dirs, engine_device):
    """The checkpoint, our model on the test device, the prompts and transformers' model (CPU,
    float32)."""
    import transformers

    path = tiny_dirs["qwen3_5_text"]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in LENGTHS]
    loaded = load_model(path, dtype=torch.float32, device=engine_device)
    return path, loaded, prompts, hf


def hf_structured(hf, tokenizer, eos: set[int], prompt: list[int], s: StructuredOutput | None,
                  max_new: int = NEW) -> list[int]:
    """transformers' greedy reply with the tokens `s`'s matcher does not allow masked at each
    step (llguidance, as the engine's), ending at an EOS id."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import transformers

    vocab = hf.config.vocab_size
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(eos))
    matcher = llguidance.LLMatcher(ll_tok, s.spec) if s is not None else None
    state = {"open": s is None or s.after_token is None, "seen": len(prompt)}

    class Mask(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if matcher is None:
                return scores
            for t in input_ids[0, state["seen"]:].tolist():
                if not state["open"]:
                    state["open"] = t == s.after_token
                elif not matcher.is_stopped():
                    matcher.consume_token(t)
            state["seen"] = input_ids.shape[1]
            if not state["open"]:
                return scores
            bits = llt.allocate_token_bitmask(1, vocab)
            llt.fill_next_token_bitmask(matcher, bits, 0)
            allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1)
            allowed = allowed.view(1, -1)[:, :scores.shape[-1]].bool()
            return scores.masked_fill(~allowed, float("-inf"))

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=sorted(eos), pad_token_id=0,
                          logits_processor=transformers.LogitsProcessorList([Mask()]))
    reply = out[0, len(prompt):].tolist()
    return reply[: next((i + 1 for i, t in enumerate(reply) if t in eos), len(reply))]


@pytest.mark.parametrize("overrides", [
    {"async_scheduling": False}, {"async_scheduling": True}, {"max_num_batched_tokens": 64},
    {"num_kv_blocks": 6, "max_num_batched_tokens": 128},
], ids=["sync", "async", "chunked", "preempted"])
def test_structured_greedy_tokens_match_transformers(setup, engine_device, overrides):
    if engine_device != "cpu" and "num_kv_blocks" in overrides:
        pytest.skip("a block count this small is a CPU-engine case")
    _, _, prompts, hf = setup
    eng = engine(setup, engine_device, **overrides)
    continued = count_continuations(eng)
    want = [hf_structured(hf, eng.tokenizer, eng.eos_ids, p, s)
            for p, s in zip(prompts, CONSTRAINTS)]
    plain = [hf_structured(hf, eng.tokenizer, eng.eos_ids, p, None) for p in prompts]
    for _ in range(2):  # the second time from the prefix cache
        seqs = [eng.add_request(p, SamplingParams(max_tokens=NEW, structured=s))
                for p, s in zip(prompts, CONSTRAINTS)]
        beside = [eng.add_request(p, SamplingParams(max_tokens=NEW)) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        assert [s.output_ids for s in seqs] == want
        assert [s.output_ids for s in beside] == plain
    outs = eng.generate(prompts, [SamplingParams(max_tokens=NEW, structured=s)
                                  for s in CONSTRAINTS])
    assert all(o.finish_reason == "stop" and holds(o.text, s) for o, s in zip(outs, CONSTRAINTS))
    assert (continued[0] > 0) == eng.async_scheduling


def test_sampled_replies_hold_to_their_constraint(setup, engine_device):
    eng = engine(setup, engine_device)
    grammar = StructuredOutput(grammar='root ::= "<" [0-9]+ ">"')
    for s in [*CONSTRAINTS, grammar]:
        out = eng.generate(setup[2][:1], SamplingParams(temperature=1.5, seed=3, n=3,
                                                        max_tokens=40, structured=s))[0]
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            if s is grammar:
                assert re.fullmatch(r"<[0-9]+>", sample.text)
            else:
                assert holds(sample.text, s)


def test_the_constraint_starts_after_its_token(setup, engine_device):
    """With after_token the plain reply's third token, the reply's first three tokens are the
    plain ones and the rest holds to the regex, as transformers gives it."""
    _, _, prompts, hf = setup
    eng = engine(setup, engine_device)
    plain = eng.generate(prompts[:1], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    gate = plain.token_ids[2]
    s = StructuredOutput(regex=REGEX, after_token=gate)
    want = hf_structured(hf, eng.tokenizer, eng.eos_ids, prompts[0], s)
    out = eng.generate(prompts[:1], SamplingParams(max_tokens=NEW, structured=s))[0]
    assert out.token_ids == want
    assert out.token_ids[:3] == plain.token_ids[:3]
    assert re.fullmatch(REGEX, eng.tokenizer.decode(out.token_ids[3:-1]))


@pytest.mark.parametrize("fields, message", [
    ({"regex": "[0-9"}, "the regex of the structured output is not valid: .*unclosed"),
    ({"json": {"type": 3}}, "the json of the structured output is not valid"),
    ({"json": "{not json"}, "the JSON schema of the structured output is not JSON"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of json, regex, choice and grammar, got regex"),
    ({}, "got none"),
    ({"choice": []}, "choice must be a list of non-empty strings"),
    ({"grammar": "root ::= word"}, "the grammar of the structured output is not valid: .*word"),
    ({"regex": "a", "after_token": -1}, "after_token must be a token id"),
    ({"regexp": "a"}, "structured takes json, regex, choice, grammar and after_token"),
])
def test_a_bad_constraint_is_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        SamplingParams(structured=fields)
    assert "\n" not in str(err.value)


def test_min_tokens_is_refused_with_a_constraint():
    with pytest.raises(ConfigError, match="min_tokens cannot be used with a structured output"):
        SamplingParams(min_tokens=2, structured={"regex": "a+"})
    params = SamplingParams(structured={"json": SCHEMA})
    assert params.structured == StructuredOutput(json=json.dumps(SCHEMA, sort_keys=True))
    assert hash(params)  # (its schema kept as text: the params stay hashable)


def test_a_failing_matcher_ends_its_own_reply_alone(setup, engine_device, monkeypatch, caplog):
    """A structured output whose matcher raises inside a step ends that reply (EOS, with a
    warning); a plain request in the same steps goes on as it would alone."""
    from statechat.engine.structured import Grammars

    _, _, prompts, _ = setup
    eng = engine(setup, engine_device)
    plain = eng.generate(prompts[1:2], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    monkeypatch.setattr(Grammars, "_catch_up", lambda self, seq: 1 / 0)
    held, beside = eng.generate(prompts[:2], [
        SamplingParams(max_tokens=8, structured=CONSTRAINTS[1]),
        SamplingParams(max_tokens=8, ignore_eos=True)])
    assert held.finish_reason == "stop" and held.token_ids[-1] in eng.eos_ids
    assert len(held.token_ids) == 1 and beside.token_ids == plain.token_ids
    assert "its reply may only end now" in caplog.text
