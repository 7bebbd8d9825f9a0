"""Sampling parameters per request and the sampler over a step's logits."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from statechat.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator; None = nondeterministic
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default=())  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # (a value that only fails when its step runs, such as a seed torch cannot take, would
        # fail every request of that step: everything is checked here, before it is queued)
        if not _finite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (
            isinstance(self.seed, numbers.Integral) and -(2**63) <= self.seed < 2**64
        ):
            raise ConfigError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except (OverflowError, TypeError):  # an int past float's range; not a number
        return False


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
