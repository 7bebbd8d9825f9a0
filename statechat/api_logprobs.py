"""OpenAI's `logprobs` object of a chat completion, from the engine's per-token logprobs.

Each generated token becomes {"token", "logprob", "bytes", "top_logprobs": [...]}: "bytes" are
the token's exact UTF-8 bytes (a byte-level BPE token may hold part of a character, which
"token" then shows as U+FFFD), and special tokens show as their text (`<|im_end|>`).
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character that stands for each byte, inverted. Printable
    Latin-1 bytes stand for themselves; the others take the characters from U+0100 on, in
    order (the scheme GPT-2 introduced and Qwen's tokenizers use)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
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


def logprobs_content(tokenizer, token_ids: list[int], logprobs: list) -> list[dict]:
    """OpenAI's logprobs.content for generated tokens and their engine entries
    ((logprob, [(id, logprob)] of the likeliest))."""
    ids = list(token_ids) + [i for _, top in logprobs for i, _ in top]
    raw = dict(zip(ids, token_bytes(tokenizer, ids)))

    def entry(i: int, logprob: float) -> dict:
        return {"token": raw[i].decode("utf-8", "replace"), "logprob": logprob,
                "bytes": list(raw[i])}

    return [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]}
            for i, (lp, top) in zip(token_ids, logprobs)]
