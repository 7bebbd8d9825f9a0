"""A reply's next turn starts from a checkpoint past the reply, also with a template that renders
the reply differently once a message follows it (Qwen3.5's: an earlier reply loses its
reasoning and the `<think>` that opened it, so the next prompt leaves the last one right after
the reply's header). The app computes that prefix while the user types; where the reply's own
checkpoints hold it, it computes nothing."""

from __future__ import annotations

import asyncio
import time

from statechat.chat.next_turn import next_turn_prefix, worth_warming
from statechat.engine.output import RequestOutput
from statechat.engine.sampling import SamplingParams
from tests.helpers import THINKING, with_template
from tests.tui.test_app import make_app, send, views, wait_ready

LONG = SamplingParams(max_tokens=150, ignore_eos=True)


def two_turns(loaded, tmp_path, template: str) -> tuple[object, dict, list[int]]:
    """Send two messages (the first reply long); (the warm-up's handle or None, the second
    reply's stats, the next-turn prefix after the first reply)."""
    async def run():
        app = make_app(with_template(loaded, template), tmp_path)
        app.sampling = LONG
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            end = time.monotonic() + 30
            while app.next_turn is None and time.monotonic() < end:
                await pilot.pause(0.05)
            warm = app.next_turn
            if warm is not None:
                warm.result(timeout=60)
            history = [m.as_chat() for m in app.chats.branch(app.conv_id)]
            prefix = next_turn_prefix(lambda ms: app.worker.render(ms, False), history)
            await send(pilot, app, "second")
            return warm, views(app)[-1].message.stats, prefix

    return asyncio.run(run())


def test_a_thinking_template_s_next_turn_is_computed_while_the_user_types(loaded, tmp_path):
    warm, stats, prefix = two_turns(loaded, tmp_path, THINKING)
    assert warm is not None and warm.output.num_completion_tokens == 0
    assert stats["cached_tokens"] == len(prefix) // 64 * 64  # (the reply's 150 tokens with it)
    assert stats["cached_tokens"] > 150


def test_a_prefix_the_reply_s_checkpoints_hold_is_not_computed_again():
    """Nothing is computed when the next prompt repeats the reply as it was made (a template
    like plain ChatML, a reply that re-tokenizes as sampled), nor for less than a block more."""
    prompt, reply = list(range(100)), list(range(100, 250))
    out = RequestOutput("r", prompt, reply, "", "length", 100, 0, 100, 150, 0.1)
    assert not worth_warming(prompt + reply + [1, 2, 3], out, 64)  # (the reply end: 192)
    assert not worth_warming(prompt[:90] + [7] * 30, out, 64)  # (the prompt end: 64)
    assert worth_warming(prompt[:90] + [7] * 200, out, 64)  # (256 past 64)
    assert worth_warming(prompt + reply[:50] + [7] * 150, out, 64)  # (the reply re-tokenized)
