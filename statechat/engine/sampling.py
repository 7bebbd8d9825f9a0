"""Sampling parameters of a request: what a user may ask for, checked when made.

The device work that honours them is statechat/engine/sampler.py."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from statechat.engine.structured import StructuredOutput
from statechat.errors import ConfigError

MAX_STOPS = 64  # stop strings (and stop token ids) a request may give: each step scans them
GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (dividing by it overflows)
TOP_P_TINY = 1.1754943508222875e-38  # float32's smallest normal number: the least top_p taken
# The sampler divides float32 logits by the temperature and the repetition penalty: past these
# bounds a value is taken as its bound, which samples as the value's limit does (by 1e39,
# infinite in float32, a logit became 0, or NaN where it was -inf; a prompt token's logit over
# 1e-39 became infinite: the draws were token 0), and keeps logits of up to 1e3 finite.
MAX_TEMPERATURE = 1e30
PENALTY_BOUNDS = (1e-30, 1e30)  # of the repetition penalty
MAX_LOGPROBS = 20  # most likely tokens a request may ask the log-probabilities of (vLLM's cap)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
MAX_BIASES = 1024  # tokens a request may bias
NO_TOKEN_CAP = 2**63 - 1  # max_tokens None (vLLM's): no cap but the context limit


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one request. Every field is checked (and normalised: a list of stops becomes
    a tuple, a numpy integer an int) when the params are made, so that a value which would
    only fail inside a step, failing every request of that step, is refused before it is
    queued."""

    temperature: float = 0.0  # below GREEDY_BELOW = greedy; taken as at most MAX_TEMPERATURE
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest; 0 = off
    presence_penalty: float = 0.0  # subtracted from the logit of each token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens
    # in the prompt or the output; 1 = off; taken within PENALTY_BOUNDS
    seed: int | None = None  # per-request generator; None = nondeterministic
    max_tokens: int = 256  # None (vLLM's): up to the context limit, kept as NO_TOKEN_CAP
    min_tokens: int = 0  # EOS (unless ignore_eos) and stop_token_ids are barred, and stop
    # strings not looked for, until this many tokens are generated (vLLM's min_tokens)
    stop: tuple[str, ...] = field(default=())  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias) pairs
    # added to the logits before everything else (OpenAI's logit_bias; a mapping is taken, its
    # keys ids or their decimal strings, as JSON gives them)
    logprobs: int | None = None  # None = off; N: each generated token's log-probability and
    # those of the N likeliest tokens at its step (raw: before temperature and penalties)
    prompt_logprobs: int | None = None  # None = off; N: the same for each prompt token after
    # the first, with its rank (the request then computes its whole prompt: see Scheduler)
    n: int = 1  # samples of the prompt (vLLM's n): generate's RequestOutput.outputs holds them,
    # sample i seeded with seed + i (engine/samples.py)
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's
    # text) at the end of the text
    skip_special_tokens: bool = True  # False: special tokens' text shows in the text
    # the reply held to a JSON schema, regex, choice or grammar (engine/structured.py; a dict
    # of StructuredOutput's fields is taken); None = free
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_lengths_and_stops()
        self._check_flags_and_counts()
        put = object.__setattr__  # (frozen)
        # what every step asks of every row, kept rather than derived each time
        put(self, "is_greedy", self.temperature < GREEDY_BELOW)  # no draw: the token is the
        # argmax (of the penalised logits, if any penalty is on)
        put(self, "uses_penalties", bool(self.presence_penalty or self.frequency_penalty
                                         or self.repetition_penalty != 1))
        # the argmax of the raw logits (which a graph replay computes with them)
        put(self, "is_plain_greedy", self.is_greedy and not self.uses_penalties)
        # logits changed before sampling: a bias, or tokens barred (the runner's ban)
        put(self, "uses_bias", bool(self.logit_bias) or self.min_tokens > 0)
        # the tokens a row may draw come from its structured output's matcher at each step
        put(self, "uses_grammar", self.structured is not None)

    def _check_sampling(self) -> None:
        """temperature, top_p, min_p, the penalties and top_k checked and clamped."""
        put = object.__setattr__  # (frozen)
        put(self, "temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        put(self, "temperature", min(self.temperature, MAX_TEMPERATURE))
        put(self, "top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        # the sampler reads top_p as float32, where a value this small would be 0 and keep no
        # token: the smallest normal float32 keeps the likeliest one alone, as top_p 1e-30 does
        put(self, "top_p", max(self.top_p, TOP_P_TINY))
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
        low, high = PENALTY_BOUNDS
        put(self, "repetition_penalty", min(max(self.repetition_penalty, low), high))
        put(self, "top_k", _integer("top_k", self.top_k))
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1 or 0 (off), or a positive count, got {self.top_k}")
        put(self, "top_k", max(self.top_k, 0))  # (vLLM's -1 is off, as 0 is)

    def _check_lengths_and_stops(self) -> None:
        """max_tokens, seed, stop and stop_token_ids checked (None: none)."""
        put = object.__setattr__  # (frozen)
        if self.max_tokens is None:
            put(self, "max_tokens", NO_TOKEN_CAP)
        put(self, "max_tokens", _integer("max_tokens", self.max_tokens))
        if self.max_tokens < 0:  # (0: the prompt alone is computed, for its prompt_logprobs)
            raise ConfigError(f"max_tokens must be >= 0, got {show_value(self.max_tokens)}")
        if self.seed is not None:
            put(self, "seed", _integer("seed", self.seed))
            if not -(2**63) <= self.seed < 2**64:
                raise ConfigError("seed must be an integer from -2**63 to 2**64 - 1, "
                                  f"got {show_value(self.seed)}")
        for name in ("stop", "stop_token_ids", "logit_bias"):  # (vLLM's None: none)
            if getattr(self, name) is None:
                put(self, name, ())
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or not all(isinstance(x, str) and x for x in stop):
            raise ConfigError("stop must be a string or a list of non-empty strings, "
                              f"got {show_value(self.stop)}")
        ids = self.stop_token_ids  # (as a prompt's ids: a list, tuple, range or 1-D int array)
        if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
            ids = ids.tolist()
        if not isinstance(ids, list | tuple | range):
            raise ConfigError(f"stop_token_ids must be a list of integers, got {show_value(ids)}")
        put(self, "stop", tuple(stop))
        put(self, "stop_token_ids", tuple(_integer("stop_token_ids", t) for t in ids))
        for name in ("stop", "stop_token_ids"):
            if len(getattr(self, name)) > MAX_STOPS:
                raise ConfigError(f"{name} may hold at most {MAX_STOPS} entries, got "
                                  f"{len(getattr(self, name))}")

    def _check_flags_and_counts(self) -> None:
        """The flags, n, min_tokens, logit_bias and the logprobs counts checked."""
        put = object.__setattr__  # (frozen)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool | np.bool_):  # ("false" would be true)
                raise ConfigError(f"{name} must be true or false, got "
                                  f"{show_value(getattr(self, name))}")
            put(self, name, bool(getattr(self, name)))
        put(self, "n", _integer("n", self.n))
        if self.n < 1:
            raise ConfigError(f"n must be at least 1, got {show_value(self.n)}")
        put(self, "min_tokens", _integer("min_tokens", self.min_tokens))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be from 0 to max_tokens ({self.max_tokens}), "
                              f"got {show_value(self.min_tokens)}")
        put(self, "logit_bias", _biases(self.logit_bias))
        if isinstance(self.structured, dict):
            try:
                put(self, "structured", StructuredOutput(**self.structured))
            except TypeError:
                raise ConfigError("structured takes json, regex, choice, grammar and "
                                  f"after_token, got {show_value(list(self.structured))}") from None
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ConfigError("structured must be a StructuredOutput (or a dict of its fields), "
                              f"got {show_value(self.structured)}")
        if self.structured is not None and self.min_tokens:
            raise ConfigError("min_tokens cannot be used with a structured output: its grammar "
                              "decides where the reply may end")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                put(self, name, _integer(name, getattr(self, name)))
                if not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                    raise ConfigError(f"{name} must be from 0 to {MAX_LOGPROBS}, got "
                                      f"{show_value(getattr(self, name))}")


def show_value(value) -> str:
    """A value for an error message, in JSON's form: the form a request's or a batch line's
    value was written in (`true`, `"hot"`, `null`, a tuple as the array it came from), which
    reads plainly for Python's values too; Python's for a value JSON has no form for (a set;
    inf and nan, as a flag gives them).
    Short, and never a number too long to print."""
    if isinstance(value, np.generic):  # (a numpy scalar: as the number it holds)
        value = value.item()
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # (no JSON form; an int past Python's digit limit)
        try:
            text = repr(value)
        except ValueError:
            return "a number too large to print"
    return text if len(text) <= 40 else text[:37] + "..."


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """ConfigError for params that are not a SamplingParams (a dict of its fields, say), or
    with a logit_bias token id outside a model's vocabulary (one past it is, on a GPU, an
    assert that ends the process), or a stop_token_ids id outside it (never sampled: the stop
    it asks for would never come)."""
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"sampling params must be a SamplingParams, got "
                          f"{type(params).__name__}; build one with SamplingParams(**fields)")
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
        raise ConfigError(f"logit_bias token id {show_value(params.logit_bias[-1][0])} is "
                          f"outside the model's vocabulary (0 to {vocab_size - 1})")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"stop_token_ids token id {show_value(bad)} is outside the model's "
                          f"vocabulary (0 to {vocab_size - 1})")


def _biases(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs: from a mapping (keys ids or decimal strings) or
    pairs; ids >= 0 (the engine checks them against its vocabulary), biases in [-100, 100]."""
    pairs = value.items() if isinstance(value, dict) else value
    try:
        pairs = list(pairs)
        if len(pairs) > MAX_BIASES:
            raise ConfigError(f"logit_bias may bias at most {MAX_BIASES} tokens, got {len(pairs)}")
        out = {}
        for key, bias in pairs:
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise ConfigError("logit_bias keys must be token ids (integers >= 0), "
                                  f"got {show_value(key)}")
            bias = _number("logit_bias", bias)
            if abs(bias) > MAX_BIAS:
                raise ConfigError("logit_bias values must be in [-100, 100], got "
                                  f"{show_value(bias)}")
            out[int(token)] = bias
    except (TypeError, ValueError):
        raise ConfigError("logit_bias must map token ids to numbers, got "
                          f"{show_value(value)}") from None
    return tuple(sorted(out.items()))


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {show_value(value)}")
    return int(value)


def _number(name: str, value) -> float:
    """A finite real number as a float (numpy scalars and ints included, bools not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {show_value(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite number, got {show_value(value)}")
    return number
