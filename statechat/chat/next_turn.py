"""Computing the next turn's prefix while the user types (`warm_next_turn`), for the app and,
once a reply is sent, for the server (`api_next_turn.warm_after_reply`).

A reply's own checkpoints (prompt end, reply end) serve the next turn only as far as the next
prompt repeats the tokens they were made from. Templates of thinking models do not: Qwen3.5's
renders an earlier reply without its reasoning (and without the `<think>` that opened it), so
the next prompt leaves the last one right after the reply's `<|im_start|>assistant\\n`, and the
next turn would compute the whole answer again. So once a reply ends, the app (or the server)
renders the conversation as the next turn's prompt will start (the template applied with a
user message after the reply, or a tool's answer after a reply with tool calls, cut where that
message's text begins) and, when that reaches at
least a block past every checkpoint the reply left, has the engine compute it (a request for
no tokens: its prompt-end checkpoint is saved, as any prompt's). The next message then
resumes from there.
With a template that repeats the reply as it was made (plain ChatML), nothing is computed.
"""

from __future__ import annotations

from collections.abc import Callable

from statechat.engine.output import RequestOutput
from statechat.engine.sampling import SamplingParams

PROBES = ("a", "b")  # two user messages whose rendered tokens differ from their text on


def next_turn_prefix(render, history: list[dict]) -> list[int]:
    """The tokens every next turn's prompt starts with: `history` (ending in the reply) with the
    next message after it, up to that message's text. `render(messages)`: the template's ids,
    with no generation prompt. After a reply with tool calls the next message is a tool's
    answer (to its first call), not a user's: Qwen3.5's template renders the calling turn's
    reasoning when no user message follows it, and leaves it out when one does."""
    a, b = (render([*history, _next_message(history[-1], probe)]) for probe in PROBES)
    return a[:_shared_len(a, b)]


def _next_message(reply: dict, text: str) -> dict:
    """The message that follows `reply` in the next turn, with `text`: a user's, or after tool
    calls the answer to the first."""
    calls = reply.get("tool_calls")
    if not calls:
        return {"role": "user", "content": text}
    call_id = calls[0].get("id")
    return {"role": "tool", "content": text, **({"tool_call_id": call_id} if call_id else {})}


def worth_warming(prefix: list[int], out: RequestOutput, block_size: int) -> bool:
    """Whether computing `prefix` leaves a checkpoint at least a block past the last one of
    `out`'s (its prompt end, its reply end: the last block boundary at or before each) that
    `prefix` repeats."""
    made = out.prompt_token_ids + out.token_ids
    same = _shared_len(prefix, made)
    # (the prompt's checkpoint lies short of its end, which a regenerate computes again; the
    # reply's last token was sampled, never fed through the model)
    ends = (len(out.prompt_token_ids) - 1, len(made) - 1)
    marks = [end // block_size * block_size for end in ends]
    have = max((mark for mark in marks if mark <= same), default=0)
    return len(prefix) // block_size * block_size >= have + block_size


def _shared_len(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` start with alike."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def warm_next_turn(worker, history: list[dict], reply: str | dict, out: RequestOutput | None,
                   template_kwargs: dict | None, still: Callable[[], bool] = lambda: True,
                   tools: list[dict] | None = None, chat_template: str | None = None):
    """(A worker thread, once a reply's stream ended) have the engine compute the next turn's
    prefix when that saves the next message work, as a speculative request (it yields to any
    other); the request's handle, else None (nothing to do: no cache, no reply text, a prefix
    the reply's checkpoints already cover, one past the context limit, or `still()` false
    once the prefix is rendered). `reply`: its text, or its whole assistant message (the
    server's, with tool calls); `tools`: the template's (the request's); `chat_template`: the
    request's own template (None: the engine's)."""
    config = worker.engine.config
    if out is None or not reply or not config.enable_prefix_cache:
        return None
    message = reply if isinstance(reply, dict) else {"role": "assistant", "content": reply}
    history = [*history, message]
    prefix = next_turn_prefix(
        lambda messages: worker.render(messages, add_generation_prompt=False,
                                       template_kwargs=template_kwargs, tools=tools,
                                       chat_template=chat_template), history)
    if len(prefix) >= worker.max_model_len or not worth_warming(prefix, out, config.block_size):
        return None
    if not still():
        return None
    return worker.submit(prefix, SamplingParams(max_tokens=0), request_id="next-turn",
                         speculative=True)
