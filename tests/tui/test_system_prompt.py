"""`statechat run --system-prompt`: a new chat begins with the system message, shown (dimmed)
as its first message, while a chat from before keeps its own messages; the system message can
be edited, which makes a new branch beside it (no reply: nothing answers it yet); and two new
chats with one system prompt share its blocks, so the second one's first reply reuses them and
its tokens are those of a run without the cache."""

from __future__ import annotations

import asyncio

from statechat.chat.next_turn import next_turn_prefix
from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.widgets.composer import Composer
from tests.tui.test_app import (
    PARAMS,
    focus_message,
    header,
    long_text,
    send,
    settled,
    status,
    views,
    wait_idle,
    wait_ready,
)

SYSTEM = "You answer in one short sentence."


def make_app(loaded, chat_dir, system_prompt: str | None) -> StatechatApp:
    config = EngineConfig(model=EMBEDDED_MODEL, device="cpu")
    return StatechatApp(config, chat_dir, loaded=loaded, sampling=PARAMS,
                        system_prompt=system_prompt)


async def new_chat(pilot, app, text: str) -> None:
    await pilot.press("ctrl+n")
    await settled(pilot, app)
    await send(pilot, app, text)


def test_a_new_chat_begins_with_the_system_message_and_an_old_chat_keeps_its_own(loaded,
                                                                                 tmp_path):
    chats = open_chats(tmp_path)
    old = chats.create("from before")
    asks = chats.add(old.id, None, "user", "asks")
    chats.add(old.id, asks.id, "assistant", "replies")
    chats.close()

    async def run():
        app = make_app(loaded, tmp_path, SYSTEM)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "more")
            assert [v.message.role for v in views(app)] == ["user", "assistant"] * 2
            await new_chat(pilot, app, "hello")
            shown = views(app)
            assert [v.message.role for v in shown] == ["system", "user", "assistant"]
            assert shown[0].message.content == SYSTEM and shown[0].has_class("system")
            assert header(shown[0]).startswith("System") and "edit" in header(shown[0])
            assert "regenerate" not in header(shown[0])
            # (what the model saw: the system message, then the user's)
            ids = app.worker.render([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": "hello"}])
            assert shown[2].message.stats["prompt_tokens"] == len(ids)

    asyncio.run(run())


def test_editing_the_system_message_makes_a_new_branch(loaded, tmp_path):
    async def run():
        app = make_app(loaded, tmp_path, SYSTEM)
        async with app.run_test(size=(120, 50), notifications=True) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            await focus_message(pilot, app, 0)
            await pilot.press("r")  # (nothing to regenerate: it says what to pick)
            await pilot.pause()
            assert app.handle is None and "Pick a reply" in list(app._notifications)[-1].message
            await pilot.press("e")
            composer = app.query_one(Composer)
            assert composer.editing == views(app)[0].message.id and composer.text == SYSTEM
            composer.set_text("You answer in French.")
            await pilot.press("enter")
            await wait_idle(pilot, app)
            await settled(pilot, app)
            shown = views(app)
            assert [v.message.content for v in shown] == ["You answer in French."]
            assert "2/2" in header(shown[0]) and app.handle is None  # (no reply to nothing)
            await send(pilot, app, "bonjour")
            assert [v.message.role for v in views(app)] == ["system", "user", "assistant"]
            await focus_message(pilot, app, 0)
            await pilot.press("left_square_bracket")
            await settled(pilot, app)
            assert [v.message.content for v in views(app)][:2] == [SYSTEM, "hello"]
            assert "1/2" in header(views(app)[0])

    asyncio.run(run())


def test_two_new_chats_with_one_system_prompt_share_its_blocks(loaded, tmp_path):
    system = long_text(7, 150)  # (some 150 tokens: two whole 64-token blocks)

    async def run():
        app = make_app(loaded, tmp_path, system)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, long_text(8, 60))
            await new_chat(pilot, app, long_text(9, 60))
            reply = views(app)[-1].message
            prompt = app.worker.render([{"role": "system", "content": system},
                                        {"role": "user", "content": long_text(9, 60)}])
            prefix = next_turn_prefix(lambda ms: app.worker.render(ms, False),
                                      [{"role": "system", "content": system}])
            return reply, status(views(app)[-1]), app.chats.token_ids(reply.id), prompt, prefix

    reply, line, made, prompt, prefix = asyncio.run(run())
    assert len(prefix) > 64 and prompt[:len(prefix)] == prefix
    assert reply.stats["cached_tokens"] == len(prefix) // 64 * 64, line
    assert f"reused {len(prefix) // 64 * 64} of {len(prompt)} prompt tokens" in line
    plain = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu",
                                   enable_prefix_cache=False), loaded=loaded)
    try:
        [out] = plain.generate([prompt], PARAMS)
    finally:
        plain.close()
    assert out.num_cached_tokens == 0 and made == out.token_ids
