"""The chat app driven with Textual's Pilot: a message streams in, an edit makes a new branch
whose status line reports reuse, a reply regenerates, branches switch, and the conversation is
there again after a restart."""

from __future__ import annotations

import asyncio
import time

import torch
from textual import events

from statechat.config import EngineConfig
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL
from statechat.tui import replies
from statechat.tui.app import StatechatApp
from statechat.tui.format import sampling_line
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.message_view import MessageView

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]


def long_text(seed: int, n: int = 120) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def make_app(loaded, chat_dir) -> StatechatApp:
    config = EngineConfig(model=EMBEDDED_MODEL, device="cpu")
    return StatechatApp(config, chat_dir, loaded=loaded, sampling=PARAMS)


async def wait_ready(pilot, app, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while app.chats is None or app.screen.id == "loading":
        assert time.monotonic() < end, "the app did not finish loading"
        await pilot.pause(0.05)
    await settled(pilot, app, timeout)  # (the first chat's views, mounted as it loaded)


async def settled(pilot, app, timeout: float = 30) -> None:
    """Wait until every view the chat shows is built and laid out, the chat scrolled to the
    focused one (ChatView._settle), and the scrolls that follow have ended: on a loaded
    machine that can come some frames after a fixed pause."""
    chat = app.query_one(ChatView)
    end = time.monotonic() + timeout
    while not all(v.is_mounted for v in views(app)) or chat.is_settling:
        assert time.monotonic() < end, "the chat's views were never built"
        await asyncio.sleep(0.01)  # (not pilot.pause: it waits for every view to be built)
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


async def wait_idle(pilot, app, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    await pilot.pause(0.05)
    while app.handle is not None:
        assert time.monotonic() < end, "the reply did not finish"
        await pilot.pause(0.05)
    await pilot.pause(0.05)


async def press_quit(pilot) -> None:
    """Ctrl+Q once the scroll that a focus move queued has run: `pilot.press` waits for the
    animator, and an animation started after the app's loop ended never completes (a test that
    moved the focus just before could wait forever on a loaded machine: test_bench_switch.py)."""
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.press("ctrl+q")


async def send(pilot, app, text: str) -> None:
    app.query_one(Composer).focus()
    app.query_one(Composer).set_text(text)
    await pilot.press("enter")
    await wait_idle(pilot, app)


def views(app) -> list[MessageView]:
    return app.query_one(ChatView).views()


def screen_lines(app) -> list[str]:
    """The screen's rows as the terminal is sent them (text only)."""
    return ["".join(seg.text for seg in strip)
            for strip in app.screen._compositor.render_strips()]


def header(view: MessageView) -> str:
    return str(view.query_one(".header").render())


def status(view: MessageView) -> str:
    return str(view.query_one(".status").render())


async def focus_message(pilot, app, index: int) -> MessageView:
    view = views(app)[index]
    view.focus()
    await pilot.pause()
    return view


def test_stream_edit_regenerate_switch_restart(loaded, tmp_path, monkeypatch):
    shown: list[str] = []
    monkeypatch.setattr(replies, "STREAM_INTERVAL_S", 0.0)
    real_show = StatechatApp._show_text
    monkeypatch.setattr(StatechatApp, "_show_text",
                        lambda self, rid, text: (shown.append(text), real_show(self, rid, text)))

    async def first_run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            assert app.query_one("#banner").display  # the embedded model is announced
            # 1. a message is sent and its reply streams in
            await send(pilot, app, long_text(1))
            assert len(shown) >= 2 and len(set(shown)) >= 2, "the reply did not stream"
            msgs = views(app)
            assert [v.message.role for v in msgs] == ["user", "assistant"]
            assert msgs[1].message.content and "TTFT" in status(msgs[1])
            await send(pilot, app, long_text(2))
            await send(pilot, app, long_text(3))
            assert len(views(app)) == 6
            # 2. edit the second user message: a new branch from there, reusing turn 1
            await focus_message(pilot, app, 2)
            await pilot.press("e")
            composer = app.query_one(Composer)
            assert composer.editing == views(app)[2].message.id
            composer.set_text(long_text(4))
            await pilot.press("enter")
            await wait_idle(pilot, app)
            msgs = views(app)
            assert len(msgs) == 4 and "2/2" in header(msgs[2])
            assert msgs[2].message.content == long_text(4)
            assert ("reused" in status(msgs[3])
                    and "no prefix reused" not in status(msgs[3])), status(msgs[3])
            # 3. regenerate the last reply: a sibling reply
            await focus_message(pilot, app, 3)
            await pilot.press("r")
            await wait_idle(pilot, app)
            msgs = views(app)
            assert "2/2" in header(msgs[3]) and "reused" in status(msgs[3])
            # 4. switch the edited message back to the original branch
            await focus_message(pilot, app, 2)
            await pilot.press("left_square_bracket")
            await settled(pilot, app)
            msgs = views(app)
            assert len(msgs) == 6 and msgs[2].message.content == long_text(2)
            assert "1/2" in header(msgs[2])
            await press_quit(pilot)

    async def second_run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            items = app.query_one(ConversationList).children
            assert len(items) == 1
            msgs = views(app)
            assert len(msgs) == 6 and msgs[4].message.content == long_text(3)
            assert "TTFT" in status(msgs[5])  # stats persisted with the reply
            # the restored conversation continues
            await send(pilot, app, "and one more")
            assert len(views(app)) == 8

    asyncio.run(first_run())
    asyncio.run(second_run())


def test_stop_generation(loaded, tmp_path):
    async def run():
        app = StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path,
                           loaded=loaded, sampling=SamplingParams(max_tokens=4000, ignore_eos=True))
        async with app.run_test() as pilot:
            await wait_ready(pilot, app)
            app.query_one(Composer).set_text("hello")
            await pilot.press("enter")
            await pilot.pause(0.3)
            assert app.handle is not None
            await pilot.press("escape")
            await wait_idle(pilot, app)
            reply = views(app)[-1]
            assert "stopped" in status(reply)
            assert reply.message.stats["completion_tokens"] < 4000

    asyncio.run(run())


def test_multiline_messages_paste_and_edit_whole(loaded, tmp_path):
    """A pasted text keeps every line, Ctrl+J and Shift+Enter break the line, Enter sends the
    whole text, and editing that message brings every line back into the box."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            composer = app.query_one(Composer)
            composer.focus()
            pasted = "def f(x):\n    return x + 1\n\nprint(f(2))"
            app.post_message(events.Paste(pasted))  # as the terminal driver delivers a paste
            await pilot.pause()
            assert composer.text == pasted
            await pilot.press("ctrl+j", "a", "shift+enter", "b")
            assert composer.text == pasted + "\na\nb"
            assert composer.size.height > 3  # the box grows with its lines
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert composer.text == ""
            msgs = views(app)
            assert [v.message.role for v in msgs] == ["user", "assistant"]
            assert msgs[0].message.content == pasted + "\na\nb"
            # the model was asked with every line (the prompt the reply was made from)
            prompt = app.worker.render([msgs[0].message.as_chat()])
            assert app.worker.engine.tokenizer.decode(prompt).count("print(f(2))\na\nb") == 1
            # editing brings back every line; Enter sends the edited whole
            msgs[0].focus()
            await pilot.pause()
            await pilot.press("e")
            assert composer.editing == msgs[0].message.id and composer.text == pasted + "\na\nb"
            await pilot.press("ctrl+j", "c", "enter")
            await wait_idle(pilot, app)
            msgs = views(app)
            assert msgs[0].message.content == pasted + "\na\nb\nc" and "2/2" in header(msgs[0])

    asyncio.run(run())


def test_template_variables_reach_the_prompt(loaded, tmp_path, monkeypatch):
    """`run --chat-template-kwargs` sets variables of the chat template (Qwen's enable_thinking)
    for every reply; here a template that says whether thinking is on."""
    monkeypatch.setattr(loaded.tokenizer, "chat_template",
                        "{% if enable_thinking is defined and not enable_thinking %}"
                        "quick {% endif %}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}")

    async def run():
        app = StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path,
                           loaded=loaded, sampling=PARAMS,
                           template_kwargs={"enable_thinking": False})
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello there")
            stats = views(app)[1].message.stats
            assert stats["prompt_tokens"] == len(loaded.tokenizer.encode("quick hello there"))
            # the sampling shown
            assert app.sub_title.endswith(f" on cpu · {sampling_line(PARAMS)}")

    asyncio.run(run())
