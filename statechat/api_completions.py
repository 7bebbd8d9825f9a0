"""POST /v1/completions, the legacy text-completions API (lm-eval-harness and many tools use
it): a body's prompts, fed as they are (no chat template), and the shape of their choices.

`prompt` is a string, an array of token ids, or an array of either; each prompt gets n choices
(index = prompt index * n + i). The sampling fields are the chat API's (api_request.parse_params),
except that max_tokens defaults to 16 (OpenAI's and vLLM's default for this API; `serve
--max-tokens` sets it) and `logprobs`
is a count (0 to 20, vLLM's cap) of the likeliest tokens to list per generated token. `echo`
puts the prompt's text before each choice's; with logprobs it is refused, since it would need
the prompt's logprobs, which the engine does not compute. `suffix` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from statechat.api_choices import Shape, finish_reason
from statechat.api_logprobs import TextOffsets, completion_logprobs
from statechat.api_request import ApiError, parse_flag, parse_n, parse_params
from statechat.engine.engine import RequestOutput, StreamEvent
from statechat.engine.sampling import MAX_LOGPROBS, SamplingParams
from statechat.engine.worker import EngineWorker

DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 256  # prompts times n, per request
# this API's own fields, taken out before the shared ones are parsed (top_logprobs, a chat
# field, is left out with them: here `logprobs` is the count)
OWN_FIELDS = ("prompt", "echo", "suffix", "logprobs", "top_logprobs", "add_special_tokens")


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams  # (max_tokens capped per prompt when submitted)
    n: int  # choices per prompt
    echoes: list[str] | None  # with echo, each prompt's text


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


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
    try:
        for p in prompts:
            if isinstance(p, str):
                p.encode()
    except UnicodeEncodeError:  # JSON's \ud800 escapes make lone surrogates
        raise ApiError(400, "prompt is not valid Unicode (a lone surrogate)", "prompt") from None
    tokenizer = worker.engine.tokenizer
    with worker.tokenizer_lock:
        return prompts, [tokenizer.encode(p, add_special_tokens=add_special_tokens)
                         if isinstance(p, str) else p for p in prompts]


def _logprobs(body: dict) -> int | None:
    """The legacy `logprobs`: how many of the likeliest tokens to list, or None (off)."""
    k = body.get("logprobs")
    if k is not None and (type(k) is not int or not 0 <= k <= MAX_LOGPROBS):
        raise ApiError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS} here "
                            "(the number of likeliest tokens to list)", "logprobs")
    return k


def parse_completion(body: dict, worker: EngineWorker, defaults: SamplingParams) -> CompletionRequest:
    """A text-completions body, checked; ApiError(400) naming the field at fault. `defaults`
    are the server's sampling, with this API's default max_tokens (ChatServer's)."""
    if body.get("suffix") not in (None, ""):
        raise ApiError(400, "suffix is not supported by this server; leave it out", "suffix")
    echo, k = parse_flag(body, "echo"), _logprobs(body)
    if echo and k is not None:
        raise ApiError(400, "echo with logprobs is not supported (the prompt's logprobs are "
                            "not computed); leave one out", "echo")
    n = parse_n(body)
    given, prompts = _prompts(body.get("prompt"), worker, parse_flag(body, "add_special_tokens", True), n)
    shared = {key: value for key, value in body.items() if key not in OWN_FIELDS}
    if k is not None:
        shared.update(logprobs=True, top_logprobs=k)
    params = parse_params(shared, min(map(len, prompts)), worker.max_model_len, defaults)
    echoes = None
    if echo:
        decode = worker.engine.tokenizer.decode
        echoes = [p if isinstance(p, str) else decode(p, skip_special_tokens=False) for p in given]
    return CompletionRequest(prompts, params, n, echoes)


class CompletionShape(Shape):
    """Choices of a text completion: `text` (the echoed prompt first, with echo) and the legacy
    `logprobs` object; a stream sends text deltas, the last with its finish_reason."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, request: CompletionRequest) -> None:
        self.tokenizer, self.echoes, self.n = tokenizer, request.echoes, request.n
        self.offsets: dict[int, TextOffsets] = {}  # a stream's, per choice

    def opening(self, index: int) -> list[dict]:
        if not self.echoes:
            return []
        return [{"index": index, "text": self.echoes[index // self.n], "logprobs": None,
                 "finish_reason": None}]

    def deltas(self, index: int, event: StreamEvent) -> list[dict]:
        logprobs = None
        if event.logprobs is not None and event.token_ids:
            offsets = self.offsets.setdefault(index, TextOffsets(self.tokenizer))
            logprobs = completion_logprobs(self.tokenizer, event.token_ids, event.logprobs, offsets)
        if not (event.text or logprobs or event.output):
            return []
        return [{"index": index, "text": event.text, "logprobs": logprobs,
                 "finish_reason": None if event.output is None else finish_reason(event.output)}]

    def choice(self, index: int, out: RequestOutput) -> dict:
        logprobs = None
        if out.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, out.token_ids, out.logprobs,
                                           TextOffsets(self.tokenizer))
        echo = self.echoes[index // self.n] if self.echoes else ""
        return {"index": index, "text": echo + out.text, "logprobs": logprobs,
                "finish_reason": finish_reason(out)}
