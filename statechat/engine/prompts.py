"""A prompt as the engine takes it: a string (tokenized) or token ids, checked against the
model's vocabulary and the context limit before anything is queued. Reads no state that
requests change, so any thread may call it."""

from __future__ import annotations

import collections.abc
import struct

import numpy as np

from statechat.cache.hashing import int32_bytes
from statechat.errors import ConfigError, ContextLengthError


def encode(tokenizer, prompt: str | list[int] | np.ndarray) -> list[int]:
    """A prompt's token ids: a string is tokenized; a list, tuple or 1-D integer numpy array
    of ids is taken as it is (check_prompt checks the ids); anything else is a one-line
    ConfigError, as is a string that is not valid Unicode (a lone surrogate: the tokenizer
    raised a TypeError about its own input types)."""
    if isinstance(prompt, str):
        _check_unicode(prompt)
        return tokenizer.encode(prompt)
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and (
            prompt.size == 0 or np.issubdtype(prompt.dtype, np.integer)):
        return prompt.tolist()
    if (isinstance(prompt, collections.abc.Sequence)
            and not isinstance(prompt, bytes | bytearray)):
        return list(prompt)
    raise ConfigError("a prompt must be a string or a list of token ids, got "
                      f"{_describe(prompt)}")


def check_prompt(
    tokenizer, prompt: str | list[int], vocab: int, max_model_len: int
) -> tuple[list[int], bytes]:
    """The prompt's token ids and their int32 bytes (what the block hashes read), checked: a
    one-line ConfigError for an empty prompt, one that leaves no room in the context, or an
    id that is not an integer of the model's vocabulary (one past the embedding table is,
    on a GPU, an assert that ends the process)."""
    ids = encode(tokenizer, prompt)
    if not ids:
        raise ConfigError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens; the context limit is {max_model_len}"
        )
    try:
        packed = int32_bytes(ids)
    except struct.error:
        raise ConfigError(f"token ids must be integers from 0 to {vocab - 1}") from None
    if not all(type(t) is int for t in ids):  # (numpy integers and bools, as ints: they would
        # stay in the request's outputs, where JSON cannot write a numpy integer)
        ids = [int(t) for t in ids]
    as_array = np.frombuffer(packed, dtype=np.int32)
    if as_array.min() < 0 or as_array.max() >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ConfigError(f"token id {bad} is outside the model's vocabulary (0 to {vocab - 1})")
    return ids, packed


def _check_unicode(text: str) -> None:
    """A one-line ConfigError for text that UTF-8 cannot encode: a lone surrogate (`"\\ud800"`
    in JSON, or a file read with errors="surrogateescape")."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ConfigError(f"the prompt is not valid Unicode: it holds a lone surrogate "
                          f"(U+{ord(text[e.start]):04X}) at character {e.start}") from None


def _describe(value) -> str:
    """What a value that is not a prompt is, for an error message."""
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D {value.dtype} numpy array"
    return type(value).__name__
