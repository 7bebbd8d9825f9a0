"""Sampling parameters per request and the sampler over a step's logits."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from statechat.errors import ConfigError

MAX_STOPS = 64  # stop strings (and stop token ids) a request may give: each step scans them
GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (dividing by it overflows)
MAX_LOGPROBS = 20  # most likely tokens a request may ask the log-probabilities of (vLLM's cap)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one request. Every field is checked (and normalised: a list of stops becomes
    a tuple, a numpy integer an int) when the params are made, so that a value which would
    only fail inside a step, failing every request of that step, is refused before it is
    queued."""

    temperature: float = 0.0  # below GREEDY_BELOW = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest; 0 = off
    presence_penalty: float = 0.0  # subtracted from the logit of each token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens
    # in the prompt or the output; 1 = off
    seed: int | None = None  # per-request generator; None = nondeterministic
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default=())  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N: each generated token's log-probability and
    # those of the N likeliest tokens at its step (raw: before temperature and penalties)

    def __post_init__(self) -> None:
        put = object.__setattr__  # (frozen)
        put(self, "temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        put(self, "top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        put(self, "min_p", _number("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, _number(name, getattr(self, name)))
            if abs(getattr(self, name)) > MAX_PENALTY:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        put(self, "repetition_penalty", _number("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
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
        if self.logprobs is not None:
            put(self, "logprobs", _integer("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ConfigError(f"logprobs must be from 0 to {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        """No draw: the token is the argmax (of the penalised logits, if any penalty is on)."""
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def is_plain_greedy(self) -> bool:
        """The argmax of the raw logits (which a graph replay computes with them)."""
        return self.is_greedy and not self.uses_penalties


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


class TokenHistory:
    """One request's tokens on the device, for its penalties: how many times each token was
    generated (presence and frequency penalties) and which tokens the prompt holds (repetition
    penalty). Each sampled token is counted on the device as it is drawn, so a step queued
    before the host has read the step before's token still sees it."""

    def __init__(self, prompt_ids: list[int], output_ids: list[int], vocab_size: int,
                 device: torch.device, params: SamplingParams) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)  # [vocab]
        self._one = torch.ones(1, dtype=torch.int32, device=device)
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.int64).to(device)
            self.counts.index_put_((ids,), self._one.expand(len(output_ids)), accumulate=True)
        self.in_prompt = None  # [vocab] bool, only for a repetition penalty
        if params.repetition_penalty != 1:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.in_prompt[torch.tensor(prompt_ids, dtype=torch.int64).to(device)] = True

    def penalize(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The logits [vocab] with p's penalties applied (vLLM's order: repetition, then
        frequency and presence), before temperature."""
        generated = self.counts > 0
        if self.in_prompt is not None:
            r = p.repetition_penalty
            row = torch.where(self.in_prompt | generated, torch.where(row > 0, row / r, row * r), row)
        if p.frequency_penalty:
            row = row - p.frequency_penalty * self.counts.to(row.dtype)
        if p.presence_penalty:
            row = row - p.presence_penalty * generated.to(row.dtype)
        return row

    def add(self, token: torch.Tensor) -> None:
        """Count a sampled token ([1] int64, on the device)."""
        self.counts.index_put_((token,), self._one, accumulate=True)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: torch.Tensor | None = None,
    histories: list[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """One token per row of logits [M, vocab] (float32), on the logits' device: the caller
    reads them all at once. `greedy`, the logits' argmax if already computed (a CUDA graph
    replays it with the model), serves the plainly greedy rows. `histories`
    holds, per row, the TokenHistory of a request with penalties (None for the others); each
    gets its row's new token."""
    if greedy is not None and all(p.is_plain_greedy for p in params):
        return greedy
    out = greedy.clone() if greedy is not None else logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.is_plain_greedy:
            continue
        history = histories[i] if histories is not None else None
        row = history.penalize(logits[i], p) if history is not None else logits[i]
        if p.is_greedy:
            out[i] = row.argmax()
        else:
            out[i] = _draw(row, p, generators[i])
        if history is not None:
            history.add(out[i : i + 1])
    return out


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """A token drawn from one row of logits [vocab] under p's temperature, top-k, min-p and
    top-p, in vLLM's order: top-p keeps the smallest set reaching its mass among the tokens
    the others kept."""
    row = row / p.temperature
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.min_p:  # prob >= min_p x the top prob, i.e. logit >= top logit + log(min_p)
        row = row.masked_fill(row < row.max() + math.log(p.min_p), float("-inf"))
    probs = row.softmax(-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    # multinomial's own draw for one sample (probs over exponential noise, argmax) without
    # its checks of the probabilities, which read them back to the host
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax()


def logprob_table(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
    """For the given rows of logits [M, vocab]: [R, 1 + 2k] float32 of each row's sampled
    token's log-probability, then the k largest log-probabilities, then their token ids (exact
    in float32: ids stay below 2**24), so that one copy brings them all to the host."""
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    logp = logits.index_select(0, index).float().log_softmax(-1)  # [R, vocab]
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None])
    top = logp.topk(k, dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def unpack_logprobs(row: list[float], k: int) -> tuple[float, list[tuple[int, float]]]:
    """One row of logprob_table, as (the sampled token's log-probability, [(id, logprob)] of
    the k likeliest, likeliest first)."""
    width = (len(row) - 1) // 2  # the table's k, of the request that asked for the most
    values, ids = row[1 : 1 + width], row[1 + width :]
    return row[0], [(int(i), v) for v, i in zip(values[:k], ids[:k])]
