"""Sampling parameters per request and the sampler over a step's logits."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from statechat.errors import ConfigError

MAX_STOPS = 64  # stop strings (and stop token ids) a request may give: each step scans them
GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (dividing by it overflows)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one request. Every field is checked (and normalised: a list of stops becomes
    a tuple, a numpy integer an int) when the params are made, so that a value which would
    only fail inside a step, failing every request of that step, is refused before it is
    queued."""

    temperature: float = 0.0  # below GREEDY_BELOW = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator; None = nondeterministic
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default=())  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__  # (frozen)
        put(self, "temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        put(self, "top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        put(self, "top_k", _integer("top_k", self.top_k))
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        put(self, "max_tokens", _integer("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {_show(self.max_tokens)}")
        if self.seed is not None:
            put(self, "seed", _integer("seed", self.seed))
            if not -(2**63) <= self.seed < 2**64:
                raise ConfigError(f"seed must be an integer from -2**63 to 2**64 - 1, got {_show(self.seed)}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(x, str) and x for x in stop):
            raise ConfigError(f"stop must be a string or a list of non-empty strings, got {_show(self.stop)}")
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise ConfigError(f"stop_token_ids must be a list of integers, got {_show(ids)}")
        put(self, "stop", tuple(stop))
        put(self, "stop_token_ids", tuple(_integer("stop_token_ids", t) for t in ids))
        if len(self.stop) > MAX_STOPS or len(self.stop_token_ids) > MAX_STOPS:
            raise ConfigError(f"at most {MAX_STOPS} stop strings and {MAX_STOPS} stop token ids")
        put(self, "ignore_eos", bool(self.ignore_eos))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _show(value) -> str:
    """A value for an error message: short, and never a number too long to print."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit
        return "a number too large to print"
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {_show(value)}")
    return int(value)


def _number(name: str, value) -> float:
    """A finite real number as a float (numpy scalars and ints included, bools not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite number, got {_show(value)}")
    return number


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [M, vocab] (float32), on the logits' device: the caller
    reads them all at once. `greedy`, the logits' argmax if already computed (a CUDA graph
    replays it with the model), saves a launch when every row is greedy."""
    if greedy is not None and all(p.is_greedy for p in params):
        return greedy
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        # multinomial's own draw for one sample (probs over exponential noise, argmax) without
        # its checks of the probabilities, which read them back to the host
        noise = torch.empty_like(probs).exponential_(1, generator=generators[i])
        out[i] = (probs / noise).argmax()
    return out
