"""A checkpoint's generation_config.json: the end-of-sequence ids and the recommended sampling
that ModelConfig.from_hf (model/config.py) takes from it. The file only refines config.json, so
a missing or damaged one is read as empty, and a bad sampling value is left out with a warning.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path

from statechat.errors import ModelError

log = logging.getLogger("statechat.model")

# generation_config.json's sampling keys that become the defaults of requests (vLLM's
# --generation-config auto), each with the test its value must pass and that test in words
GENERATION_SAMPLING = {
    "temperature": (lambda v: v >= 0, "a number >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: v >= -1 and v.is_integer(), "a whole number >= -1"),  # -1 = off, as 0
    "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: v > 0, "a number > 0"),
}



def read_generation_config(path: Path) -> dict:
    """`path/generation_config.json` as a dict; {} when it is missing or damaged (it only
    refines what config.json gives)."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return {}
    try:
        gen = json.loads(gen_file.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):
        return {}
    return gen if isinstance(gen, dict) else {}


def eos_ids(gen: dict, text: dict, path: Path) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's when present, else config.json's (of the
    checkpoint directory `path`, named in the error for a value of another type)."""
    eos = gen.get("eos_token_id", text.get("eos_token_id"))
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        where = path / ("generation_config.json" if "eos_token_id" in gen else "config.json")
        raise ModelError(f"{where} field 'eos_token_id' must be an integer or a list of "
                         f"integers, got {eos!r:.60}")
    return tuple(ids)


def sampling_defaults(gen: dict, path: Path) -> tuple[tuple[str, float | int], ...]:
    """generation_config.json's recommended sampling (GENERATION_SAMPLING's keys; do_sample is
    ignored, as vLLM does). A value of the wrong type or range is left out with a warning: it
    only sets defaults, so it should not stop the model from loading."""
    out = []
    for key, (is_ok, rule) in GENERATION_SAMPLING.items():
        if gen.get(key) is None:
            continue
        value = _finite(gen[key])
        if value is None or not is_ok(value):
            _warn_once(f"{path / 'generation_config.json'}: ignoring {key} {gen[key]!r:.40} "
                       f"(it must be {rule})")
            continue
        out.append((key, max(int(value), 0) if key == "top_k" else value))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    """A warning logged once per process (a command reads the config before loading the
    model, which reads it again)."""
    log.warning("statechat: %s", message)


def _finite(value) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, a string, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        return None
    return number if math.isfinite(number) else None
