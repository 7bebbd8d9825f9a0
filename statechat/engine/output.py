"""What a request gives back: its text made from token ids as they come, stop strings cut out,
its logprobs, and the RequestOutput and StreamEvent the engine's callers read.

Plain Python over a Sequence's fields; the engine calls these as steps return tokens.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from statechat.engine.logprobs import unpack_logprobs, unpack_scores
from statechat.engine.sampling import SamplingParams
from statechat.engine.sequence import Sequence

PROMPT_CONTEXT = 4  # prompt tokens decoded before a reply's first: they hold at most the 3 bytes
# of an unfinished character (UTF-8's longest is 4)
MAX_HELD = 3  # reply tokens held back with no whole character before the text goes on: a
# character's bytes (4 at most) that begin in the first held token end by the 4th


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens reused from the cache
    num_computed_tokens: int  # prompt tokens computed (recomputation after preemption included;
    # for a request aborted before its prompt was done, what was computed of it)
    num_completion_tokens: int
    ttft_s: float | None
    decode_s: float | None = None  # first token to last: the time of the other tokens' decode
    reused_from: str | None = None  # tier the reused prefix came from: device, host or disk
    reused_by_tier: dict | None = None  # reused prompt tokens by the tier their KV came from
    cache_plan: dict | None = None  # the cheapest prefix to load, its predicted load and
    # recompute seconds, the choice made and (when loaded) where the load's time went
    logprobs: list | None = None  # per token, when asked: (logprob, [(id, logprob)] of the top)
    prompt_logprobs: list | None = None  # per prompt token, when asked: None for the first,
    # then (logprob, [(id, logprob)] of the top, rank)
    stop_reason: str | int | None = None  # what stopped it (vLLM's): the stop string matched,
    # the stop_token_ids token or an EOS id other than the tokenizer's; None for the
    # tokenizer's EOS and for any other end
    index: int = 0  # which of its request's n samples it is (vLLM's CompletionOutput.index)
    others: tuple[RequestOutput, ...] = ()  # with n > 1, samples 1 to n - 1 (see outputs)

    @property
    def outputs(self) -> list[RequestOutput]:
        """The request's samples in order, as vLLM's RequestOutput.outputs: this one (sample 0,
        whose fields the request's own are) then `others`. Each has vLLM's CompletionOutput
        fields (index, text, token_ids, logprobs, finish_reason, stop_reason) and its own
        counts (reuse, computed, completion tokens)."""
        return [dataclasses.replace(self, others=()), *self.others] if self.others else [self]


@dataclass(frozen=True)
class StreamEvent:
    """A text delta of one request, with the token ids it came from (and their logprobs, when
    asked); `output` on the last. The first event of a request that asked for prompt_logprobs
    carries them (its prompt is computed by then). `index`: the sample it belongs to, in a
    stream of a request for n > 1 samples (each sample's last event carries its output)."""

    text: str
    token_ids: list[int]
    output: RequestOutput | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    index: int = 0


def request_output(seq: Sequence) -> RequestOutput:
    """What `seq` has made so far (all of it once it has finished)."""
    cached = max(seq.num_cached_tokens, 0)
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
        token_ids=list(seq.output_ids),
        text=seq.text,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=cached,
        num_computed_tokens=max(min(seq.num_computed, seq.num_prompt_tokens) - cached, 0)
        + seq.num_recomputed,
        num_completion_tokens=len(seq.output_ids),
        ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
        decode_s=None if seq.first_token_time is None
        else seq.last_token_time - seq.first_token_time,
        reused_from=seq.reused_from if cached else None,
        reused_by_tier=dict(seq.reused_by_tier) if cached else None,
        cache_plan=seq.cache_plan,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        prompt_logprobs=prompt_logprobs(seq),
        stop_reason=seq.stop_reason,
    )


def next_event(
    seq: Sequence, sent_text: int, sent_tokens: int
) -> tuple[StreamEvent | None, int, int]:
    """A stream's next event for `seq` after `sent_text` characters and `sent_tokens` tokens
    (None when there is nothing new), and the new counts. Until the request finishes, text
    that may still begin a stop string is held back: a stop is never streamed (unless the
    request keeps it: include_stop_str_in_output, whose text is cut after the stop in the step
    that completes it)."""
    text = seq.text
    if seq.params.stop and not seq.params.include_stop_str_in_output and not seq.is_finished:
        text = text[: max(len(text) - stop_hold(seq.params), sent_text)]
    delta, ids = text[sent_text:], seq.output_ids[sent_tokens : seq.num_text_tokens]
    out = request_output(seq) if seq.is_finished else None
    logprobs = None
    if seq.params.logprobs is not None:
        logprobs = seq.logprobs[sent_tokens : seq.num_text_tokens]
    first = sent_text == 0 and sent_tokens == 0
    event = None
    if delta or ids or out:
        event = StreamEvent(delta, ids, out, logprobs, prompt_logprobs(seq) if first else None)
    return event, len(text), seq.num_text_tokens


def detokenize(decode: Callable[[list[int]], str], seq: Sequence, final: bool,
               drop_last: bool = False) -> None:
    """Extend seq.text incrementally (a few tokens decoded per step, not the whole reply);
    a trailing partial UTF-8 character is held back until it completes. `drop_last` (the
    reply's last token, a stop token) adds no text but counts as turned into text.

    Each step decodes seq.detok_window: a context, whose text is shown already, then the tokens
    held back since (bytes that made no whole character yet), then the new ones. Until the
    first text, the context is the last PROMPT_CONTEXT prompt tokens (vLLM's priming), and the
    reply's text is what they do not already show: a character whose first bytes end the prompt
    (a prompt of token ids may end inside one) shows whole, rather than as U+FFFD for the bytes
    the reply completes it with.

    Tokens that decode to nothing (special tokens, which decode skips) are left out of the
    window: a run of them costs a token's decode a step, not the run's, bytes held back before
    it or not (such a character still shows whole when its bytes come after the run). More than
    MAX_HELD tokens held back make the text go on: it shows all but the character they leave
    unfinished, whose bytes begin the next context (so the window stays a few tokens, and a
    reply that never finishes a character shows U+FFFD for it, as a decode of it all does)."""
    ids, num_prompt = seq.token_ids, seq.num_prompt_tokens
    end = len(ids) - num_prompt - drop_last
    # (window[:read] is the context; the last `unshown` characters of its text are not shown
    # yet; `seen` reply tokens have been looked at)
    read, seen, unshown = seq.detok_offsets
    window = seq.detok_window
    if seen == 0:
        window = ids[num_prompt - min(PROMPT_CONTEXT, num_prompt) : num_prompt]
        read = len(window)
    added = ids[num_prompt + seen : num_prompt + end]
    context = decode(window[:read])
    before = context[: len(context) - unshown]
    after = decode(window + added)
    # (before shows whole characters, which more bytes leave as they were, except for the
    # prompt's unfinished one: its U+FFFD gives way to the character)
    shown = len(before) if after.startswith(before) else len(os.path.commonprefix([before, after]))
    new = after[shown:]
    held = window[read:] + added
    if not final and added and not decode(added) and (
            after == (context if len(window) == read else decode(window))):
        seq.detok_window, seq.detok_offsets = window, (read, end, unshown)  # (no bytes among
        # them: a byte that goes on a character still held back may add nothing either, yet is
        # kept)
    elif final or (new and not new.endswith("\ufffd")) or len(held) > MAX_HELD:
        unshown = int(not final and new.endswith("\ufffd"))  # (it may still be completed)
        seq.text += new[: len(new) - unshown]
        seq.detok_window, seq.detok_offsets = held, (len(held), end, unshown)
        seq.num_text_tokens = len(ids) - num_prompt
    else:
        seq.detok_window, seq.detok_offsets = window + added, (read, end, unshown)


def token_end(seq: Sequence, eos_ids: set[int], eos_token_id: int | None,
              max_model_len: int) -> tuple[str | None, bool]:
    """Whether `seq` ends with its last token, before its text is looked at (cut_at_stop), and
    whether that token is a stop token (its text is dropped): "stop" for an EOS id (unless
    ignore_eos) or a stop_token_ids token, which sets seq.stop_reason (its id; None for the
    tokenizer's EOS, `eos_token_id`: vLLM's), else "length" at max_tokens or the context
    limit, else None. A stop token comes first: sampled as the last token allowed, it is the
    model's own end (vLLM's check_stop so orders)."""
    p, token = seq.params, seq.token_ids[-1]
    is_eos = token in eos_ids and not p.ignore_eos
    if is_eos or token in p.stop_token_ids:
        seq.stop_reason = None if is_eos and token == eos_token_id else token
        return "stop", True
    if len(seq.output_ids) >= p.max_tokens or len(seq) >= max_model_len:
        return "length", False
    return None, False


def cut_at_stop(seq: Sequence, shown: int) -> bool:
    """Cut seq.text at the first of its stop strings, looking from where a stop could begin in
    the text past `shown` characters, and keep the stop matched as seq.stop_reason; whether one
    was found. Of stops the same text completes, the one that begins first wins (the first
    listed of those beginning there). Not in the first min_tokens tokens, as vLLM's; also in
    the last token of a reply that ends for another reason. With include_stop_str_in_output
    the text keeps the stop, and is cut after it."""
    p = seq.params
    if not p.stop or len(seq.output_ids) <= p.min_tokens:
        return False
    # a stop ending in the new text starts at most its length - 1 before it (each stop its
    # own: a shorter one found further back lay in text already checked, or in the first
    # min_tokens tokens, which are not)
    found = ((seq.text.find(s, max(shown - len(s) + 1, 0)), k) for k, s in enumerate(p.stop))
    cut, k = min(((i, k) for i, k in found if i >= 0), default=(-1, -1))
    if cut < 0:
        return False
    end = cut + len(p.stop[k]) if p.include_stop_str_in_output else cut
    seq.text, seq.stop_reason = seq.text[:end], p.stop[k]
    return True


def keep_logprobs(batch, table: list[list[float]]) -> None:
    """Give each sequence that asked for logprobs its row of the step's table (rows in the
    order of the items that sampled; one whose sequence ended meanwhile is skipped)."""
    rows = iter(table)
    for it in batch.items:
        k = it.seq.params.logprobs
        if it.needs_logits and k is not None:
            row = next(rows)
            if not it.seq.is_finished:
                it.seq.logprobs.append(unpack_logprobs(row, k))


def keep_prompt_logprobs(batch, scored: list[tuple[int, int, int]], table: np.ndarray) -> None:
    """Give each scored item's sequence its rows of the step's prompt table, by position (a
    preempted request that computes its prompt again writes the same entries again)."""
    row = 0
    for i, start, n in scored:
        seq = batch.items[i].seq
        if not seq.prompt_logprobs:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens
        entries = unpack_scores(table[row : row + n], seq.params.prompt_logprobs)
        seq.prompt_logprobs[start + 1 : start + 1 + n] = entries
        row += n


def prompt_logprobs(seq: Sequence) -> list | None:
    """A request's prompt logprobs (None for the first token), when it asked for them."""
    if seq.params.prompt_logprobs is None:
        return None
    return list(seq.prompt_logprobs) or [None] * seq.num_prompt_tokens


def stop_hold(params: SamplingParams) -> int:
    """Characters at the end of a reply's text that may be the start of a stop string."""
    return max(map(len, params.stop)) - 1


def fast_decode(tokenizer, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """ids -> text, without special tokens unless `skip_special_tokens` is False. A fast
    tokenizer that cleans up no spaces decodes through its Rust backend directly: the same
    text, without transformers' per-call Python (a few decodes run every step of every
    request)."""
    skip = skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
