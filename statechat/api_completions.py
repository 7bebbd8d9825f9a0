"""POST /v1/completions, the legacy text-completions API (lm-eval-harness and many tools use
it): a body's prompts, fed as they are (no chat template), and the shape of their choices.

`prompt` is a string, an array of token ids, or an array of either; each prompt gets n choices
(index = prompt index * n + i). The sampling fields are the chat API's (api_request.parse_params),
except that max_tokens defaults to 16 (OpenAI's and vLLM's default for this API; `serve
--max-tokens` sets it) and `logprobs`
is a count (0 to 20, vLLM's cap) of the likeliest tokens to list per generated token. `echo`
puts the prompt's text before each choice's, and with logprobs the prompt's tokens and their
logprobs before the reply's (the first token's null), which scores a prompt (lm-eval-harness's
loglikelihood requests ask for one token and read the entries before it; max_tokens 0, which
only echo allows, gives the prompt alone). vLLM's
`prompt_logprobs` gives each choice that field, in whole responses. A prompt's logprobs are
computed once (by its choice 0) for its n choices. `suffix` is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from statechat.api_logprobs import (
    TextOffsets,
    completion_logprobs,
    echoed_logprobs,
    vllm_prompt_logprobs,
)
from statechat.api_request import (
    SHARED_FIELDS,
    ApiError,
    parse_flag,
    parse_n,
    parse_params,
    whole_number,
)
from statechat.api_response import Shape, finish_reason
from statechat.engine.engine import RequestOutput, StreamEvent
from statechat.engine.sampling import MAX_LOGPROBS, SamplingParams
from statechat.engine.worker import EngineWorker

DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 256  # prompts times n, per request
# this API's own fields, taken out before the shared ones are parsed (top_logprobs, a chat
# field, is left out with them: here `logprobs` is the count)
OWN_FIELDS = ("prompt", "echo", "suffix", "logprobs", "top_logprobs", "add_special_tokens")
# the fields this API reads (a body's others, top_logprobs among them, are logged as unknown)
COMPLETION_FIELDS = (SHARED_FIELDS | set(OWN_FIELDS)) - {"top_logprobs"}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams  # (max_tokens capped per prompt when submitted)
    n: int  # choices per prompt
    echoes: list[str] | None  # with echo, each prompt's text
    logprobs: int | None  # the legacy count (with echo, the prompt's tokens are listed too)
    prompt_logprobs: int | None  # vLLM's field, as asked


def _is_ids(value) -> bool:
    """Whether `value` is token ids: whole numbers (5.0 is 5, as vLLM's models take it)."""
    return isinstance(value, list) and all(whole_number(t) is not None for t in value)


def _prompts(raw, worker: EngineWorker, add_special_tokens: bool,
             n: int) -> tuple[list, list[list[int]]]:
    """Each prompt as given (a string or token ids) and its token ids (a string through the
    tokenizer's encode; Qwen's adds no BOS). Their number is checked before any is encoded
    (encoding holds the tokenizer, which every chat request needs)."""
    prompts = [raw] if isinstance(raw, str) or _is_ids(raw) else raw
    if not isinstance(prompts, list) or not prompts or \
            not all(isinstance(p, str) or _is_ids(p) for p in prompts):
        raise ApiError(400, "prompt must be a string, an array of token ids, or a non-empty "
                            "array of strings or of token-id arrays", "prompt")
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"a request may ask for at most {MAX_CHOICES} choices (prompts "
                            f"times n), not {len(prompts) * n}", "prompt")
    prompts = [p if isinstance(p, str) else [whole_number(t) for t in p] for p in prompts]
    try:
        for p in prompts:
            if isinstance(p, str):
                p.encode()
    except UnicodeEncodeError:  # JSON's \ud800 escapes make lone surrogates
        raise ApiError(400, "prompt is not valid Unicode (a lone surrogate)", "prompt") from None
    texts = sum(len(p) for p in prompts if isinstance(p, str))
    with worker.tokenizer_for(texts) as tokenizer:
        return prompts, [tokenizer.encode(p, add_special_tokens=add_special_tokens)
                         if isinstance(p, str) else p for p in prompts]


def _logprobs(body: dict) -> int | None:
    """The legacy `logprobs`: how many of the likeliest tokens to list, or None (off)."""
    if body.get("logprobs") is None:
        return None
    k = whole_number(body["logprobs"])
    if k is None or not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS} here "
                            "(the number of likeliest tokens to list)", "logprobs")
    return k


def parse_completion(body: dict, worker: EngineWorker,
                     defaults: SamplingParams) -> CompletionRequest:
    """A text-completions body, checked; ApiError(400) naming the field at fault. `defaults`
    are the server's sampling, with this API's default max_tokens (ChatServer's)."""
    if body.get("suffix") not in (None, ""):
        raise ApiError(400, "suffix is not supported by this server; leave it out", "suffix")
    echo, k = parse_flag(body, "echo"), _logprobs(body)
    n = parse_n(body)
    given, prompts = _prompts(body.get("prompt"), worker,
                              parse_flag(body, "add_special_tokens", True), n)
    shared = {key: value for key, value in body.items() if key not in OWN_FIELDS}
    if k is not None:
        shared.update(logprobs=True, top_logprobs=k)
    if whole_number(body.get("max_tokens")) == 0 and not echo:
        raise ApiError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)",
                       "max_tokens")
    params = parse_params(shared, min(map(len, prompts)), worker.max_model_len, defaults,
                          least_tokens=0 if echo else 1,
                          vocab_size=worker.engine.loaded.config.vocab_size,
                          longest_len=max(map(len, prompts)))
    echoes = None
    if echo:
        decode = worker.engine.tokenizer.decode
        echoes = [p if isinstance(p, str) else decode(p, skip_special_tokens=False) for p in given]
        if k is not None:  # (the engine's count is the larger of the two asked for)
            params = dataclasses.replace(params,
                                         prompt_logprobs=max(k, params.prompt_logprobs or 0))
    return CompletionRequest(prompts, params, n, echoes, k,
                             whole_number(body.get("prompt_logprobs")))


class CompletionShape(Shape):
    """Choices of a text completion: `text` (the echoed prompt first, with echo) and the legacy
    `logprobs` object; a stream sends text deltas, the last with its finish_reason (and each
    with a stop_reason, null until the last, as vLLM's)."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, request: CompletionRequest) -> None:
        self.tokenizer, self.echoes, self.n = tokenizer, request.echoes, request.n
        self.prompts, self.k = request.prompts, request.logprobs
        self.prompt_k = request.prompt_logprobs
        self.offsets: dict[int, TextOffsets] = {}  # a stream's, per choice
        # per prompt, its logprobs objects (echoed, vLLM's), made once for its n choices
        self.echoed: dict[int, dict] = {}
        self.scored: dict[int, list] = {}

    def opening(self, index: int) -> list[dict]:
        if not self.echoes or self.k is not None:  # (with logprobs the echo waits for the
            # prompt's: the first delta)
            return []
        return [{"index": index, "text": self.echoes[index // self.n], "logprobs": None,
                 "finish_reason": None, "stop_reason": None}]

    def deltas(self, index: int, event: StreamEvent) -> list[dict]:
        text, logprobs = event.text, None
        if self.k is not None:
            offsets = self.offsets.get(index)
            if offsets is None:  # the first event: the echo and its logprobs first
                echo, offsets = self._echo(index, event.prompt_logprobs)
                text, logprobs = echo["text"] + text, echo["logprobs"]
                self.offsets[index] = offsets
            if event.token_ids:
                more = completion_logprobs(self.tokenizer, event.token_ids, event.logprobs, offsets)
                logprobs = more if logprobs is None else _joined(logprobs, more)
        if not (text or logprobs or event.output):
            return []
        # (stop_reason on every chunk, null until the last: vLLM's completions stream)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None,
                  "stop_reason": None}
        if event.output is not None:
            choice.update(finish_reason=finish_reason(event.output),
                          stop_reason=event.output.stop_reason)
        return [choice]

    def choice(self, index: int, out: RequestOutput) -> dict:
        echo, offsets = self._echo(index, out.prompt_logprobs)
        logprobs = echo["logprobs"]
        if out.logprobs is not None:
            more = completion_logprobs(self.tokenizer, out.token_ids, out.logprobs, offsets)
            logprobs = more if logprobs is None else _joined(logprobs, more)
        choice = {"index": index, "text": echo["text"] + out.text, "logprobs": logprobs,
                  "finish_reason": finish_reason(out), "stop_reason": out.stop_reason}
        if self.prompt_k is not None:
            p = index // self.n
            if p not in self.scored:
                self.scored[p] = vllm_prompt_logprobs(self.tokenizer, out.prompt_token_ids,
                                                      _cut(out.prompt_logprobs, self.prompt_k))
            choice["prompt_logprobs"] = self.scored[p]
        return choice

    def _echo(self, index: int, entries: list | None) -> tuple[dict, TextOffsets]:
        """Choice `index`'s echo: {"text", "logprobs" (the prompt's, or None)}, and the offsets
        of the reply's tokens after it."""
        if not self.echoes:
            return {"text": "", "logprobs": None}, TextOffsets(self.tokenizer)
        p = index // self.n
        text = self.echoes[p]
        if self.k is not None and p not in self.echoed:
            self.echoed[p] = echoed_logprobs(self.tokenizer, self.prompts[p], _cut(entries, self.k))
        return ({"text": text, "logprobs": self.echoed.get(p)},
                TextOffsets(self.tokenizer, start=len(text)))


def _cut(entries: list, k: int) -> list:
    """Prompt logprob entries with the top lists cut to k (the engine's may be longer)."""
    return [e if e is None else (e[0], e[1][:k], e[2]) for e in entries]


def _joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs objects as one (first's tokens, then then's)."""
    return {key: first[key] + then[key] for key in first}
