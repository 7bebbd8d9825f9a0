"""Text made from token ids as they come, with the embedded model's Qwen3.5 tokenizer (byte-level
BPE: its tiny vocabulary spells CJK, emoji and accents a byte a token): a stream's deltas join to
the reply's text, no delta shows U+FFFD for a character split across tokens, and a reply whose
prompt ends inside a character (a prompt of token ids) shows that character whole. Each step
decodes a few ids, however long a run of special tokens or of bytes that finish no character,
and the text is then a decode of the whole reply, cut before a stop string where a whole decode
first shows one."""

from __future__ import annotations

import os
import random

import pytest
import torch
from transformers import AutoTokenizer

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.output import cut_at_stop, detokenize, fast_decode, next_event
from statechat.engine.sampling import SamplingParams
from statechat.engine.sequence import Sequence, Status
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL

TEXTS = ["中文 and 日本語", "😀👍 🇺🇸 👨‍👩‍👧", "q\u0307 ñ नमस्ते", "plain words"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def streamed(tokenizer, prompt: list[int], reply: list[int]) -> list[str]:
    """The deltas of `reply`'s tokens coming one a step after `prompt`, as the engine makes
    them (the last ends the reply)."""
    decode = fast_decode(tokenizer)
    seq = Sequence(list(prompt), SamplingParams(max_tokens=len(reply)))
    deltas, sent_text, sent_tokens = [], 0, 0
    for i, token in enumerate(reply):
        seq.token_ids.append(token)
        final = i == len(reply) - 1
        detokenize(decode, seq, final=final)
        seq.status = Status.FINISHED if final else seq.status
        event, sent_text, sent_tokens = next_event(seq, sent_text, sent_tokens)
        deltas += [event.text] if event is not None else []
    assert "".join(deltas) == seq.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_text_and_hold_split_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) or text == "plain words"  # (characters split across tokens)
    deltas = streamed(tokenizer, tokenizer.encode("Hi"), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_a_prompt_that_ends_inside_a_character(tokenizer, text):
    """Wherever the prompt's ids end (inside a character, too), the reply's text is the rest of
    the whole text, that character whole: its bytes in the reply gave U+FFFD."""
    ids = tokenizer.encode(text)
    for cut in range(1, len(ids) - 1):
        prompt = tokenizer.decode(ids[:cut])
        whole = prompt.rstrip("\ufffd")  # (its unfinished character)
        reply = "".join(streamed(tokenizer, ids[:cut], ids[cut:]))
        assert whole + reply == text, (cut, prompt, reply)


def test_the_engine_shows_the_character_a_prompt_began():
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=256),
                       loaded=loaded)
    prompt = engine.tokenizer.encode("Hello 中")[:-1]  # (ends with two of its three bytes)
    last = engine.tokenizer.encode("中")[-1]
    params = SamplingParams(max_tokens=1, logit_bias={last: 100})
    assert engine.generate(prompt, params)[0].text == "中"
    assert "".join(e.text for e in engine.stream(prompt, params)) == "中"


def counting(decode, lengths: list[int]):
    """`decode`, noting the number of ids of each call in `lengths`."""
    def counted(ids: list[int]) -> str:
        lengths.append(len(ids))
        return decode(ids)
    return counted


def test_special_tokens_cost_a_token_each(tokenizer):
    """A run of tokens that decode to nothing (special tokens, skipped) is not decoded again at
    every step after it: each decode holds a few ids, however long the run (a reply of 300 once
    passed 300 ids at its last step). The text around them, and a character the prompt began,
    come out as a whole decode gives them."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    lengths: list[int] = []
    decode = counting(fast_decode(tokenizer), lengths)
    seq = Sequence(tokenizer.encode("Hi"), SamplingParams(max_tokens=300))
    for i in range(300):
        seq.token_ids.append(special)
        detokenize(decode, seq, final=i == 299)
    assert seq.text == "" and max(lengths) <= 4 + 1, max(lengths)
    ids = tokenizer.encode("Hello 中文 and 😀")
    prompt, rest = ids[:-1], ids[-1:]  # (the emoji's last byte ends it)
    reply = [special] * 50 + rest + [special] * 50 + tokenizer.encode(" x") + [special] * 50
    lengths.clear()
    seq = Sequence(list(prompt), SamplingParams(max_tokens=len(reply)))
    for i, token in enumerate(reply):
        seq.token_ids.append(token)
        detokenize(decode, seq, final=i == len(reply) - 1)
    assert tokenizer.decode(prompt).endswith("and \ufffd")
    assert seq.text == "😀 x"
    assert max(lengths) <= 4 + 3, max(lengths)


def test_the_engine_decodes_a_reply_of_special_tokens_in_bounded_steps():
    """A reply forced to a special token (logit_bias, ignore_eos) has no text, and no step's
    decode grows with it."""
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=256),
                       loaded=loaded)
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    lengths: list[int] = []
    engine._decoders[True] = counting(engine._decoders[True], lengths)
    params = SamplingParams(max_tokens=120, logit_bias={special: 100}, ignore_eos=True)
    out = engine.generate(engine.tokenizer.encode("Hello"), params)[0]
    assert (out.text, out.token_ids) == ("", [special] * 120)
    assert len(lengths) >= 240 and max(lengths) <= 4 + 1, max(lengths)


def detokenized(decode, prompt: list[int], reply: list[int]) -> str:
    """The text `detokenize` makes of `reply`'s tokens coming one a step after `prompt`."""
    seq = Sequence(list(prompt), SamplingParams(max_tokens=len(reply)))
    for i, token in enumerate(reply):
        seq.token_ids.append(token)
        detokenize(decode, seq, final=i == len(reply) - 1)
    return seq.text


def test_bytes_that_make_no_character_cost_a_few_tokens_a_step(tokenizer):
    """A reply that leaves a character unfinished (a byte token, 0xE4, that begins 中) and goes
    on with special tokens, or with more bytes that never finish one, decodes a few ids a step
    (it once decoded the whole run again at every step), and its text is the whole reply's
    decode, U+FFFD and all."""
    e4, tail = tokenizer.convert_tokens_to_ids("ä"), tokenizer.encode("中")[1:]
    assert tokenizer.decode([e4]) == "\ufffd" and tokenizer.decode([e4] + tail) == "中"
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    decode, prompt = fast_decode(tokenizer), tokenizer.encode("Hi")
    for reply in ([e4] + [special] * 300, [e4] * 300, [e4] * 300 + tail + [special] * 5):
        lengths: list[int] = []
        text = detokenized(counting(decode, lengths), prompt, reply)
        assert text == decode(reply)
        assert max(lengths) <= 4 + 4 + 1, max(lengths)


def test_mixed_bytes_and_special_tokens_give_the_whole_decode(tokenizer):
    """Replies of byte tokens (whole characters, their pieces and stray ones), special tokens
    and words, in random order, make the text a decode of the whole reply makes, a few ids a
    step; a character split by special tokens shows whole."""
    pieces = [tokenizer.encode(t) for t in ["中", "😀", "ñ", " word", "a"]]
    pieces.append([tokenizer.convert_tokens_to_ids("<|im_start|>")] * 3)
    pieces += [p[:1] for p in pieces[:3]] + [p[1:] for p in pieces[:3]]
    decode, prompt = fast_decode(tokenizer), tokenizer.encode("Hi")
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        order = torch.randint(len(pieces), (30,), generator=gen).tolist()
        reply = [i for k in order for i in pieces[k]]
        lengths: list[int] = []
        assert detokenized(counting(decode, lengths), prompt, reply) == decode(reply), order
        assert max(lengths) <= 4 + 4, max(lengths)
    split = pieces[0][:1] + pieces[5] * 20 + pieces[0][1:]
    assert detokenized(decode, prompt, split) == "中"


def one_shot(decode, prompt: list[int], reply: list[int], stops: list[str],
             keep: bool = False) -> tuple[int, str]:
    """(tokens until the reply ends, its text) from whole decodes: the first prefix of the reply
    whose text holds a stop ends it there, cut before the stop (after it, when `keep`s); the
    reply's text is what a decode of prompt + reply adds to the prompt's (a character the
    prompt began shows whole)."""
    for k in range(1, len(reply) + 1):
        before, whole = decode(prompt), decode(prompt + reply[:k])
        text = whole[len(os.path.commonprefix([before, whole])):]
        hits = [(i, n) for n, i in enumerate(text.find(s) for s in stops) if i >= 0]
        if hits:
            at, n = min(hits)
            return k, text[: at + len(stops[n]) * keep]
    return len(reply), text


@pytest.mark.parametrize(("skip", "keep"), [(True, False), (False, True)],
                         ids=["default", "specials-and-stops-kept"])
def test_random_replies_with_stops_match_a_whole_decode(tokenizer, skip, keep):
    """Prompts that end anywhere (inside a character too) and replies of whole characters, their
    pieces, stray bytes and special tokens, with stop strings: the reply ends at the token a
    whole decode first shows a stop in, its text and its stream are that decode cut before the
    stop, and no delta shows a stop; with skip_special_tokens false and
    include_stop_str_in_output, that decode keeping special tokens, cut after the stop."""
    decode, rng = fast_decode(tokenizer, skip), random.Random(0)
    texts = ["中", "😀", "ñ", " word", "a", "é", "नम", "\n", "!", "ab"]
    pieces = [tokenizer.encode(t) for t in texts]
    pieces += [p[:k] for p in pieces[:7] for k in range(1, len(p))]
    pieces += [p[k:] for p in pieces[:7] for k in range(1, len(p))]
    pieces.append([tokenizer.convert_tokens_to_ids("<|im_start|>")])
    pieces += [[tokenizer.convert_tokens_to_ids(c)] for c in "äðĳ¸"]  # (lone bytes: 0xE4 and
    # 0xF0 begin a character, 0x91 and 0xB8 go on one)
    for _ in range(400):
        ids = tokenizer.encode("".join(rng.choice(texts) for _ in range(rng.randint(1, 4))))
        prompt = ids[: rng.randint(1, len(ids))]
        reply = [i for _ in range(rng.randint(1, 20)) for i in rng.choice(pieces)]
        stops = rng.sample(["中", "ab", "é!", "\n", "ñ w", "😀", "a中", "b", "!"], 2)
        seq = Sequence(list(prompt), SamplingParams(max_tokens=len(reply), stop=stops,
                                                    skip_special_tokens=skip,
                                                    include_stop_str_in_output=keep))
        streamed, sent_text, sent_tokens = "", 0, 0
        for n, token in enumerate(reply, start=1):
            seq.token_ids.append(token)
            shown = len(seq.text)
            detokenize(decode, seq, final=n == len(reply))
            ended = cut_at_stop(seq, shown) or n == len(reply)
            seq.status = Status.FINISHED if ended else seq.status
            event, sent_text, sent_tokens = next_event(seq, sent_text, sent_tokens)
            streamed += event.text if event is not None else ""
            assert keep or not any(s in streamed for s in stops), (prompt, reply[:n], stops)
            if ended:
                break
        assert (n, seq.text) == one_shot(decode, prompt, reply, stops, keep), (prompt, reply,
                                                                                stops)
        assert streamed == seq.text


def test_a_request_aborted_inside_a_character_keeps_its_last_tokens(monkeypatch):
    """Aborted while its last tokens hold two of a character's three bytes (the server's
    SIGINT, a user's stop), a reply's text is a decode of all its tokens, as a finished one's
    is, and its stream's last event carries them with their logprobs: the deltas join to the
    text and the events' tokens and logprobs to every token counted."""
    from tests.helpers import force_reply

    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=256,
                                    enable_prefix_cache=False), loaded=loaded)
    ids = force_reply(engine, monkeypatch, "ab中")
    seq = engine.add_request("Hello", SamplingParams(max_tokens=20, logprobs=0))
    text, tokens, logprobs, sent = "", [], [], (0, 0)
    while len(seq.output_ids) < 4:  # ("a", "b", then two bytes of 中)
        engine.step()
        event, *sent = engine.next_event(seq, *sent)
        if event is not None:
            text, tokens, logprobs = text + event.text, tokens + event.token_ids, logprobs + (
                event.logprobs)
    assert seq.output_ids == ids[:4] and seq.num_text_tokens < 4  # (bytes held back)
    engine.abort(seq)
    event, *_ = engine.next_event(seq, *sent)
    out = event.output
    text, tokens, logprobs = text + event.text, tokens + event.token_ids, logprobs + (
        event.logprobs)
    assert out.finish_reason == "abort" and out.num_completion_tokens == 4
    assert out.text == text == engine.tokenizer.decode(ids[:4]) == "ab\ufffd"
    assert out.token_ids == tokens == ids[:4] and len(logprobs) == len(out.logprobs) == 4
