"""What a continuation is given: a reply's kept ids where they make its text (its text
tokenized where none were kept, or they no longer match it, or hold an id no token has), never
the stop token that closed it nor the part of a character an aborted reply held back, and, for
a reply cut inside a character, the ids before that character, so that the model writes it
whole."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from statechat.chat.continuing import Start, reply_start, text_token_ids
from statechat.engine.output import RequestOutput
from statechat.paths import EMBEDDED_MODEL

EOS = 2  # the embedded tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL)  # (byte-level: é is two ids)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def output(ids: list[int], text: str, finish: str) -> RequestOutput:
    return RequestOutput("r", [1], ids, text, finish, 1, 0, 1, len(ids), 0.1)


def test_kept_ids_that_make_the_text_are_fed_back_as_they_are(tokenizer):
    made = [69, 225, 69]  # (as the model sampled them: "a", " ", "a"; " a" is one id, 264)
    text = tokenizer.decode(made)
    assert encode(tokenizer, text) != made
    assert reply_start(tokenizer, text, made) == Start(text, tuple(made))
    assert reply_start(tokenizer, text, None) == Start(text, tuple(encode(tokenizer, text)))
    edited = text + " and more"  # (the row's text changed by hand: its ids are not its own)
    assert reply_start(tokenizer, edited, made).token_ids == tuple(encode(tokenizer, edited))


def test_kept_ids_past_the_tokenizer_are_not_fed_back(tokenizer):
    # (the row's ids changed by hand: an id no token has decodes to nothing, so they still
    # "made" the text, and the continuation was refused as a prompt with an id outside the
    # vocabulary, in a reply the user could not mend)
    made = [69, len(tokenizer) + 5, 69]
    text = tokenizer.decode(made)
    assert text == "aa"
    assert reply_start(tokenizer, text, made) == Start(text, tuple(encode(tokenizer, text)))
    assert reply_start(tokenizer, text, made, vocab_size=len(tokenizer) + 5) == Start(
        text, tuple(encode(tokenizer, text)))


def test_kept_ids_in_the_model_s_padded_vocabulary_are_fed_back(tokenizer):
    # (a model's vocabulary may run past its tokenizer's, as Qwen3.5's does: an id sampled
    # there decodes to nothing, and is fed back as made, so the reply's checkpoints match)
    made = [69, len(tokenizer) + 5, 69]
    text = tokenizer.decode(made)
    got = reply_start(tokenizer, text, made, vocab_size=len(tokenizer) + 64)
    assert got == Start(text, tuple(made))


def test_a_reply_cut_inside_a_character_goes_on_from_before_it(tokenizer):
    whole = encode(tokenizer, "café au")
    cut = whole[:4]  # "caf" and the first byte of é, shown as U+FFFD
    assert tokenizer.decode(cut) == "caf\ufffd"
    assert reply_start(tokenizer, "caf\ufffd", cut) == Start("caf", tuple(whole[:3]))
    emoji = encode(tokenizer, "a\U0001f600")[:4]  # three of the emoji's four bytes
    assert reply_start(tokenizer, "a\ufffd", emoji) == Start("a", (emoji[0],))


def test_the_ids_kept_are_those_of_the_text(tokenizer):
    ids = encode(tokenizer, "café au")
    # the stop token that ended it is left out; an id like it that did not end it stays
    assert text_token_ids(tokenizer, output([*ids, EOS], "café au", "stop"), {EOS}) == ids
    assert text_token_ids(tokenizer, output([*ids, EOS], "café au", "length"), {EOS}) == [*ids, EOS]
    # an abort held back the first byte of a character: its text has none of it
    assert text_token_ids(tokenizer, output(ids[:4], "caf", "abort"), {EOS}) == ids[:3]
    # at max tokens the engine shows that byte as U+FFFD: the ids stay whole
    assert text_token_ids(tokenizer, output(ids[:4], "caf\ufffd", "length"), {EOS}) == ids[:4]
    # a stop string cut the text inside the ids: none make it
    assert text_token_ids(tokenizer, output(ids, "ca", "stop"), {EOS}) is None
