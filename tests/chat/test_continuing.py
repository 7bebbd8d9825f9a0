"""What a continuation is given: a reply's kept ids where they make its text (its text
tokenized where none were kept, or they no longer match it, or hold an id no token has), never
the stop token that closed it nor the part of a character an aborted reply held back; a reply
that ends inside a character is given whole, the bytes of that character too, so that the model
goes on from the very token it stopped at (finishing the character, or not), and the
continuation's text shows that character once, as a decode of all its ids does."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from statechat.chat.continuing import Start, continued_text, reply_start, text_token_ids
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


def test_a_reply_cut_inside_a_character_goes_on_from_its_own_ids(tokenizer):
    # (it went on from before that character: the model made its bytes again, and a reply
    # that had ended of itself just after them was "continued" by the same tokens, kept as a
    # second branch identical to the first)
    whole = encode(tokenizer, "café au")
    cut = whole[:4]  # "caf" and the first byte of é, shown as U+FFFD
    assert tokenizer.decode(cut) == "caf\ufffd"
    start = reply_start(tokenizer, "caf\ufffd", cut)
    assert (start.text, start.token_ids) == ("caf\ufffd", tuple(cut))
    assert (start.open_ids, start.open_text) == ((cut[3],), "\ufffd")
    emoji = encode(tokenizer, "a\U0001f600")[:4]  # three of the emoji's four bytes
    start = reply_start(tokenizer, "a\ufffd", emoji)
    assert start.token_ids == tuple(emoji) and start.open_ids == tuple(emoji[1:])
    assert reply_start(tokenizer, "café", whole[:5]).open_ids == ()  # (a whole character)


def test_a_continuation_shows_the_character_it_finishes_once(tokenizer):
    whole = encode(tokenizer, "café au")
    start = reply_start(tokenizer, "caf\ufffd", whole[:4])
    decode = tokenizer.decode
    assert continued_text(start, "", [], decode) == "caf\ufffd"  # (nothing yet: as it was)
    # the engine shows the character its first bytes finish whole: it replaces the U+FFFD
    made = whole[4:]
    assert continued_text(start, "é au", made, decode) == "café au" == decode(whole)
    # bytes that do not finish it: the U+FFFD stays, and the text goes on after it
    other = encode(tokenizer, " x")
    assert continued_text(start, " x", other, decode) == "caf\ufffd x"
    assert decode([*whole[:4], *other]) == "caf\ufffd x"
    # a reply that ends in whole characters: its text, then the continuation's
    assert continued_text(Start("ab", (1, 2)), "cd", [3], decode) == "abcd"


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
    # a continuation's ids follow the ids of the reply it continues, whose last byte it finished
    ids = encode(tokenizer, "café au")
    start = reply_start(tokenizer, "caf\ufffd", ids[:4])
    out = output([*ids[4:], EOS], "é au", "stop")
    assert text_token_ids(tokenizer, out, {EOS}, start, "café au") == ids


class ByteTokenizer:
    """A byte-level tokenizer whose ids may hold whole characters and part of the next one
    (as real BPE vocabularies' " \\xe4\\xb8", a space and two bytes of 中, do)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def engine_text(decode, prompt: list[int], reply: list[int]) -> str:
    """The engine's text of `reply` made after `prompt` (engine/output.py's detokenize)."""
    from statechat.engine.output import detokenize
    from statechat.engine.sampling import SamplingParams
    from statechat.engine.sequence import Sequence

    seq = Sequence(list(prompt), SamplingParams(max_tokens=len(reply)),
                   num_prompt_tokens=len(prompt))
    for i, token in enumerate(reply):
        seq.token_ids.append(token)
        detokenize(decode, seq, final=i == len(reply) - 1)
    return seq.text


@pytest.mark.parametrize("stored", [[0, 1], [0, 4, 5]])
def test_a_finished_character_keeps_what_its_ids_showed_before_it(stored):
    # (id 1 holds a space and the first bytes of 中; ids 4 and 5 hold 中 and the first bytes
    # of 文 between them: the reply's text ends with more than the U+FFFD they leave open)
    tok = ByteTokenizer([b"a", " \u4e2d".encode()[:3], " \u4e2d".encode()[3:], b"x",
                         "\u4e2d".encode()[:2], "\u4e2d\u6587".encode()[2:5], b"\x87"])
    text = tok.decode(stored)
    start = reply_start(tok, text, stored)
    assert start.token_ids == tuple(stored) and start.open_ids
    made_ids = [2, 3] if stored[-1] == 1 else [6, 3]
    made = engine_text(tok.decode, stored, made_ids)
    whole = tok.decode([*stored, *made_ids])
    assert "\ufffd" not in whole
    assert continued_text(start, made, made_ids, tok.decode) == whole
