"""OpenAI's `usage` of one API request's choices, whole or as a stream's last chunk.

Each prompt is counted once (its `cached_tokens` those of its choice that reused the least),
and the completion tokens of every choice are summed; a shape that reports more of them (a
chat split by a reasoning parser: `reasoning_tokens`) adds `completion_tokens_details`, summed
over the choices as well. Without one that field is left out, as vLLM leaves it out without a
reasoning parser (OpenAI's 0 there would claim that no reasoning was made, where none was
looked for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statechat.engine.engine import RequestOutput

if TYPE_CHECKING:
    from statechat.api_choices import Shape


def usage(outputs: list[RequestOutput], n: int, shape: Shape | None = None) -> dict:
    """The usage of `outputs`, n choices per prompt in order (choice index = prompt * n + i);
    `shape`'s completion_details when it gives them."""
    prompts = [outputs[k : k + n] for k in range(0, len(outputs), n)]
    prompt_tokens = sum(group[0].num_prompt_tokens for group in prompts)
    completion_tokens = sum(out.num_completion_tokens for out in outputs)
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(min(out.num_cached_tokens for out in group) for group in prompts)},
    }
    details = None if shape is None else shape.completion_details(outputs)
    if details is not None:
        counts["completion_tokens_details"] = details
    return counts
