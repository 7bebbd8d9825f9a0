"""OpenAI's `logprobs` objects, from the engine's per-token logprobs.

Chat: each generated token becomes {"token", "logprob", "bytes", "top_logprobs": [...]}:
"bytes" are the token's exact UTF-8 bytes (a byte-level BPE token may hold part of a character,
which "token" then shows as U+FFFD), and special tokens show as their text (`<|im_end|>`).
Text completions (the legacy API): {"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}; there a token that is not whole UTF-8 shows as its bytes, as
OpenAI's did ("bytes:\\xe4\\xbd"), so that no two tokens of a top_logprobs dict show alike.
With echo, the prompt's tokens come first, the first with null logprobs (nothing comes before
it), and the offsets count the echoed prompt.
vLLM's `prompt_logprobs`: per prompt token null (the first), else {id: {"logprob", "rank",
"decoded_token"}} of the token and the likeliest.
"""

from __future__ import annotations

import codecs
from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character that stands for each byte, inverted. Printable
    Latin-1 bytes stand for themselves; the others take the characters from U+0100 on, in
    order (the scheme GPT-2 introduced and Qwen's tokenizers use)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token's bytes: a byte-level piece mapped back to its bytes, an added or special
    token (or a piece outside the byte alphabet) as its text in UTF-8."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    byte_of = _byte_of_char()
    out = []
    for i, piece in zip(ids, pieces):
        piece = piece or ""
        if i in added or not all(c in byte_of for c in piece):
            out.append(piece.encode())
        else:
            out.append(bytes(byte_of[c] for c in piece))
    return out


def _bytes_of(tokenizer, token_ids: list[int], logprobs: list) -> dict[int, bytes]:
    """The bytes of the generated tokens and of those in their top lists."""
    ids = list(token_ids) + [i for entry in logprobs if entry is not None for i, _ in entry[1]]
    return dict(zip(ids, token_bytes(tokenizer, ids)))


def logprobs_content(tokenizer, token_ids: list[int], logprobs: list) -> list[dict]:
    """OpenAI's logprobs.content for generated tokens and their engine entries
    ((logprob, [(id, logprob)] of the likeliest))."""
    raw = _bytes_of(tokenizer, token_ids, logprobs)

    def entry(i: int, logprob: float) -> dict:
        return {"token": raw[i].decode("utf-8", "replace"), "logprob": logprob,
                "bytes": list(raw[i])}

    return [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]}
            for i, (lp, top) in zip(token_ids, logprobs)]


class TextOffsets:
    """Where each generated token starts in the reply's text, in characters, token after token
    (a stream's chunks continue the count). A token that starts inside a character starts where
    that character does; special tokens, which the text leaves out, take no room."""

    def __init__(self, tokenizer, start: int = 0, specials_shown: bool = False) -> None:
        """`start`: the characters before the first token; `specials_shown`: special tokens
        take the room of their text (as in an echoed prompt)."""
        self.special = set() if specials_shown else set(tokenizer.all_special_ids)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # holds a partial character
        self.num_chars = start

    def add(self, token_id: int, raw: bytes) -> int:
        """The offset of the next token, `token_id` with bytes `raw`."""
        start = self.num_chars
        if token_id not in self.special:
            pending = self.decoder.getstate()[0]
            if pending and raw and not 0x80 <= raw[0] <= 0xBF:
                start += 1  # the unfinished character before it ends here, as one U+FFFD
            self.num_chars += len(self.decoder.decode(raw))
        return start


def _legacy_token(raw: bytes) -> str:
    """A token as the legacy API shows it: its text, or "bytes:\\xNN..." when it is not whole
    UTF-8 (part of a character)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list,
                        offsets: TextOffsets) -> dict:
    """The legacy API's logprobs object for tokens and their engine entries. A token's
    top_logprobs dict holds the likeliest tokens, likeliest first, and the token itself (so up
    to k + 1 entries, as OpenAI's); a None entry (a prompt's first token, or one a stopped
    request did not compute) shows as nulls."""
    raw = _bytes_of(tokenizer, token_ids, logprobs)
    shown = {i: _legacy_token(b) for i, b in raw.items()}
    tops: list[dict | None] = []
    for i, found in zip(token_ids, logprobs):
        if found is None:
            tops.append(None)
            continue
        entry: dict[str, float] = {}
        for j, value in found[1]:
            entry.setdefault(shown[j], value)
        entry.setdefault(shown[i], found[0])
        tops.append(entry)
    return {"tokens": [shown[i] for i in token_ids],
            "token_logprobs": [None if entry is None else entry[0] for entry in logprobs],
            "top_logprobs": tops, "text_offset": [offsets.add(i, raw[i]) for i in token_ids]}


def echoed_logprobs(tokenizer, prompt_ids: list[int], entries: list) -> dict:
    """The legacy logprobs object of an echoed prompt, from the engine's prompt_logprobs
    entries (the first None): offsets into the prompt's text, special tokens included."""
    return completion_logprobs(tokenizer, prompt_ids, entries,
                               TextOffsets(tokenizer, specials_shown=True))


def vllm_prompt_logprobs(tokenizer, prompt_ids: list[int], entries: list) -> list[dict | None]:
    """vLLM's prompt_logprobs from the engine's entries: per token after the first, the token
    first, then the likeliest (ranks 1, 2, ... in order; the token once), keyed by id, as vLLM
    orders them; None where the entry is (the first token, or one a stopped request did not
    compute)."""
    raw = _bytes_of(tokenizer, prompt_ids, entries)
    text = {i: b.decode("utf-8", "replace") for i, b in raw.items()}
    out: list[dict | None] = [None]
    for i, entry in zip(prompt_ids[1:], entries[1:]):
        if entry is None:
            out.append(None)
            continue
        logprob, top, rank = entry
        row = {str(i): {"logprob": logprob, "rank": rank, "decoded_token": text[i]}}
        for r, (j, v) in enumerate(top, 1):
            row.setdefault(str(j), {"logprob": v, "rank": r, "decoded_token": text[j]})
        out.append(row)
    return out
