"""Plain-words text for the app: a reply's status line, and safe display of model text."""

from __future__ import annotations

import re

# (a reply's reasoning and a title on one line: chat/transcript.py's, which the CLI uses too)
from statechat.chat.transcript import one_line, split_thinking  # noqa: F401

# control characters (tab and line feed kept), line/paragraph separators, and the bidi marks,
# embeddings, overrides and isolates that reorder what follows them; the zero-width (non-)joiners
# stay, as emoji sequences and Persian or Indic words need them
_CONTROL = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufffd]")


def clean(text: str) -> str:
    """Model text safe for the terminal: control and bidi characters become U+00B7."""
    return _CONTROL.sub("\u00b7", text)


def sampling_line(params) -> str:
    """A SamplingParams in a few words, the fields left at their off values left out:
    "temperature 0.6, top-p 0.95, top-k 20, presence 1.5" or "greedy"."""
    parts = [f"temperature {params.temperature:g}" if not params.is_greedy else "greedy"]
    for name, value, off in (("top-p", params.top_p, 1), ("top-k", params.top_k, 0),
                             ("min-p", params.min_p, 0), ("presence", params.presence_penalty, 0),
                             ("frequency", params.frequency_penalty, 0),
                             ("repetition", params.repetition_penalty, 1)):
        is_penalty = name in ("presence", "frequency", "repetition")
        if value != off and (is_penalty or not params.is_greedy):
            parts.append(f"{name} {value:g}")
    return ", ".join(parts)


def chat_title(first_message: str) -> str:
    """The title a chat takes from its first message: on one line, cut to 48 characters."""
    return one_line(first_message)[:48]


def reply_stats(output, continued_tokens: int = 0, max_model_len: int | None = None) -> dict:
    """The numbers a reply's status line shows (persisted with the message): the decode rate
    is the engine's, over the tokens after the first, from their sampling times. A
    continuation's (`continued_tokens`: the tokens of the reply it goes on from, part of its
    prompt) counts its own generation: the tokens it added, its prompt's reuse. A reply cut
    where its prompt and it fill `max_model_len` (the context limit) keeps that limit, as
    `context_limit`: it ended there, not at its max tokens, and cannot be continued."""
    decode_s, num_tokens = output.decode_s, output.num_completion_tokens
    tps = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s else None
    stats = {
        "ttft_s": output.ttft_s,
        "tokens_per_s": tps,
        "prompt_tokens": output.num_prompt_tokens,
        "cached_tokens": output.num_cached_tokens,
        "computed_tokens": output.num_computed_tokens,
        "completion_tokens": output.num_completion_tokens,
        "reused_from": output.reused_from,
        "finish_reason": output.finish_reason,
    }
    if continued_tokens:
        stats["continued_tokens"] = continued_tokens
    filled = output.num_prompt_tokens + output.num_completion_tokens
    if output.finish_reason == "length" and max_model_len and filled >= max_model_len:
        stats["context_limit"] = max_model_len
    return stats


def status_line(stats: dict) -> str:
    """E.g. 'TTFT 12 ms · 85.3 tok/s · 40 tokens · reused 8,192 of 8,240 prompt tokens from
    disk checkpoint; computed 48'; a continuation's says '40 tokens more (240 in all)', the
    tokens it added and the reply's with those it went on from; how the reply ended, unless
    of itself ('stopped', 'hit max tokens', 'hit the context limit (N tokens)'); '' for stats
    of the wrong types (a row edited by hand). Cleaned as model text is: an error's words
    (or a row's) may hold control characters."""
    try:
        return clean(_status_line(stats))
    except (TypeError, ValueError):
        return ""


def _status_line(stats: dict) -> str:
    if not stats:
        return ""
    if stats.get("error"):
        return f"error: {stats['error']}"
    if stats.get("unfinished"):  # (saved as it streamed: see ChatStore.save_unfinished)
        return "unfinished: still streaming, or cut off (saved as it came)"
    parts = []
    if stats.get("ttft_s") is not None:
        parts.append(f"TTFT {stats['ttft_s'] * 1000:,.0f} ms")
    if stats.get("tokens_per_s"):
        parts.append(f"{stats['tokens_per_s']:,.1f} tok/s")
    num_tokens = stats.get("completion_tokens", 0)
    tokens = f"{num_tokens:,} token" + ("" if num_tokens == 1 else "s")
    if stats.get("continued_tokens"):
        tokens += f" more ({num_tokens + stats['continued_tokens']:,} in all)"
    parts.append(tokens)
    prompt, cached = stats.get("prompt_tokens", 0), stats.get("cached_tokens", 0)
    computed = stats.get("computed_tokens", prompt - cached)
    if cached:
        tier = stats.get("reused_from")
        where = f"{tier} checkpoint" if tier else "cache checkpoint"
        parts.append(f"reused {cached:,} of {prompt:,} prompt tokens from {where}; "
                     f"computed {computed:,}")
    else:
        parts.append(f"no prefix reused; computed {computed:,} prompt tokens")
    if stats.get("finish_reason") == "abort":
        parts.append("stopped")
    elif stats.get("finish_reason") == "length" and stats.get("context_limit"):
        parts.append(f"hit the context limit ({stats['context_limit']:,} tokens)")
    elif stats.get("finish_reason") == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)
