"""The bytes of a logprobs entry are the token's own: the entries of any text's tokens join
back to exactly that text (characters split across tokens included), a token that is a whole
character reads as the tokenizer's decode of it, and a special token shows as its text. The
legacy (text-completions) object shows a part of a character as its bytes, gives each token's
character offset in the text (the parts of a character at its start, a special token taking
no room), and lists the chosen token among the top ones. A prompt's entries of a request
stopped before its prompt was computed show as nulls where they are missing."""

from __future__ import annotations

from transformers import AutoTokenizer

from statechat.api_logprobs import (
    TextOffsets,
    completion_logprobs,
    echoed_logprobs,
    logprobs_content,
    token_bytes,
    vllm_prompt_logprobs,
)
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL


def test_token_bytes_join_back_to_the_text():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    text = "héllo wörld <|im_end|> 你好 \n\t\x00 ∑ 🙂 tail"
    ids = tokenizer.encode(text)
    assert b"".join(token_bytes(tokenizer, ids)) == text.encode()
    every = list(range(len(tokenizer)))
    for i, raw in zip(every, token_bytes(tokenizer, every)):
        try:
            assert raw.decode() == tokenizer.decode([i], skip_special_tokens=False)
        except UnicodeDecodeError:  # part of a character: the decode shows U+FFFD
            assert "\ufffd" in tokenizer.decode([i], skip_special_tokens=False)


def test_content_entries():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("ok")[:1] + [end]
    entries = logprobs_content(tokenizer, ids, [(-0.5, [(ids[0], -0.5), (end, -1.0)]), (-2.0, [])])
    assert [e["token"] for e in entries] == [tokenizer.decode(ids[:1]), "<|im_end|>"]
    assert entries[0]["top_logprobs"][1] == {"token": "<|im_end|>", "logprob": -1.0,
                                             "bytes": list(b"<|im_end|>")}
    assert entries[1]["logprob"] == -2.0 and entries[1]["top_logprobs"] == []


def test_legacy_object():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("a你b"), end, *tokenizer.encode("c")]  # 你 is three byte tokens
    entries = [(-1.0, [(ids[0], -1.0), (ids[1], -2.0)])] + [(-0.5, [])] * (len(ids) - 1)
    legacy = completion_logprobs(tokenizer, ids, entries, TextOffsets(tokenizer))
    assert legacy["tokens"] == ["a", "bytes:\\xe4", "bytes:\\xbd", "bytes:\\xa0", "b",
                                "<|im_end|>", "c"]
    assert legacy["text_offset"] == [0, 1, 1, 1, 2, 3, 3]
    assert legacy["top_logprobs"][0] == {"a": -1.0, "bytes:\\xe4": -2.0}
    assert legacy["top_logprobs"][1] == {"bytes:\\xe4": -0.5}  # the chosen token, always
    assert legacy["token_logprobs"] == [-1.0] + [-0.5] * 6


def test_text_offsets_after_an_unfinished_character():
    """A byte that cannot finish the character before it ends that character as one U+FFFD:
    the next token starts after it, as in the reply's text ('a\ufffdnb')."""
    from types import SimpleNamespace

    from statechat.api_logprobs import TextOffsets

    no_specials = SimpleNamespace(all_special_ids=())
    offsets = TextOffsets(no_specials)
    assert [offsets.add(i, b) for i, b in enumerate([b"a", b"\xd8", b"n", b"b"])] == [0, 1, 2, 3]
    offsets = TextOffsets(no_specials)  # a character split across tokens starts with its first
    pieces = [b"a", b"\xe4", b"\xbd\xa0", b"b", b"\xe4\xbd", b"\xa0"]
    assert [offsets.add(i, b) for i, b in enumerate(pieces)] == [0, 1, 1, 2, 3, 3]


def test_prompt_entries_of_a_stopped_request():
    """Aborted after its first 64-token chunk, a request has the entries of that chunk's rows
    only; both prompt formats show the rest as nulls (the server answers a request stopped at
    shutdown with them)."""
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_num_batched_tokens=64))
    prompt = list(range(10, 209))
    seq = engine.add_request(prompt, SamplingParams(max_tokens=4, prompt_logprobs=2))
    engine.step()
    engine.abort(seq)
    entries = engine.output(seq).prompt_logprobs
    assert entries[0] is None and all(e is not None for e in entries[1:65])
    assert all(e is None for e in entries[65:])
    legacy = echoed_logprobs(engine.tokenizer, prompt, entries)
    assert len(legacy["tokens"]) == len(legacy["text_offset"]) == len(prompt)
    assert legacy["token_logprobs"][65:] == [None] * (len(prompt) - 65)
    assert legacy["top_logprobs"][64] is not None and legacy["top_logprobs"][65] is None
    vllm = vllm_prompt_logprobs(engine.tokenizer, prompt, entries)
    assert vllm[64] is not None and vllm[65:] == [None] * (len(prompt) - 65)
