"""The bytes of a logprobs entry are the token's own: the entries of any text's tokens join
back to exactly that text (characters split across tokens included), a token that is a whole
character reads as the tokenizer's decode of it, and a special token shows as its text."""

from __future__ import annotations

from transformers import AutoTokenizer

from statechat.api_logprobs import logprobs_content, token_bytes
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
