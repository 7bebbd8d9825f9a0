"""What the screen shows: a reply's decode rate is the engine's (it was timed from when the
app began reading the stream, so it was inflated, or missing), a one-token reply says
"1 token", zero-width joiners stay in text and titles (emoji and Persian words broke), a
small terminal leaves room for the messages and the box, Tab and Shift+Tab move through the
same parts at every width (a narrow terminal's chat list kept the focus), no terminal size,
nor any run of resizes, crashes the app (growing back from 30x8 did), the focused message
stands out from the others, and no control character of a path or a stored error reaches the
terminal."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from rich.console import Group
from rich.text import Text
from textual.geometry import Region

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from tests.helpers import THINKING, with_template
from tests.tui.test_app import (
    PARAMS,
    make_app,
    screen_lines,
    send,
    status,
    views,
    wait_idle,
    wait_ready,
)
from tests.tui.test_edge_cases import start_long_reply


def test_the_decode_rate_is_the_engines(loaded, tmp_path, monkeypatch):
    """Here the app reads the stream only once the reply is done, as a busy app may."""
    sampled: list[tuple[float, int]] = []  # (when a step returned, the reply's tokens by then)
    real_step, real_submit = LLMEngine.step, EngineWorker.submit

    def step(self):
        updated = real_step(self)
        sampled.extend((time.perf_counter(), len(seq.output_ids)) for seq in updated)
        return updated

    def submit_and_wait(self, *args, **kwargs):
        handle = real_submit(self, *args, **kwargs)
        while handle.seq is None or not handle.seq.is_finished:
            time.sleep(0.01)
        return handle

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(EngineWorker, "submit", submit_and_wait)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            stats = views(app)[1].message.stats
            n = stats["completion_tokens"]
            first, last = (next(t for t, k in sampled if k == i) for i in (1, n))
            # (loose: the steps' own timing differs from the engine's by its bookkeeping; the
            # old figure, timed from the stream's thread, was 100s of times off here)
            assert stats["tokens_per_s"] == pytest.approx((n - 1) / (last - first), rel=0.5)
            assert f"{stats['tokens_per_s']:,.1f} tok/s" in status(views(app)[1])

    asyncio.run(run())


def test_a_one_token_reply(loaded, tmp_path):
    async def run():
        app = StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path,
                           loaded=loaded, sampling=SamplingParams(max_tokens=1, ignore_eos=True))
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            line = status(views(app)[1])
            assert " · 1 token · " in line and "tok/s" not in line, line

    asyncio.run(run())


def test_joiners_stay_and_bidi_overrides_go(loaded, tmp_path):
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # man, woman, girl: joined
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # (a non-joiner inside)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, f"{family} {persian} \u202eevil\u2066")
            shown = str(views(app)[0].query_one(".body").render())
            title = str(app.query_one(ConversationList).query_one("Label").render())
            for text in (shown, title):
                assert text == f"{family} {persian} \u00b7evil\u00b7"

    asyncio.run(run())


def shows_thought(view) -> bool:
    """Whether a reply's view begins with its reasoning, dimmed as `thinking: ...`."""
    body = view._body()
    first = body.renderables[0] if isinstance(body, Group) else body
    return (isinstance(first, Text) and first.plain.startswith("thinking: ")
            and "dim" in str(first.style))


def test_reasoning_a_thinking_prompt_opened_shows_dimmed_as_it_streams(loaded, tmp_path):
    """Qwen3.5's template opens `<think>` in the prompt, so the reasoning streams with no tag
    of its own: it showed as the answer (Markdown) until `</think>` came, and for good in a
    reply stopped, or cut at max tokens, before it. It shows dimmed as `thinking: ...` as it
    streams, once stopped, and after a restart; a continuation of it too."""
    config = EngineConfig(model=EMBEDDED_MODEL, device="cpu")
    sampling = SamplingParams(max_tokens=4000, ignore_eos=True)

    async def first_run():
        app = StatechatApp(config, tmp_path, loaded=with_template(loaded, THINKING),
                           sampling=sampling)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            while not views(app)[1].text:
                await pilot.pause(0.05)
            assert shows_thought(views(app)[1])  # streaming
            await pilot.press("escape")
            await wait_idle(pilot, app)
            assert "stopped" in status(views(app)[1]) and shows_thought(views(app)[1])
            await pilot.press("shift+tab", "c")
            await pilot.pause(0.3)
            assert app.handle is not None and shows_thought(views(app)[1])
            await pilot.press("escape")
            await wait_idle(pilot, app)
            assert "2/2" in str(views(app)[1].query_one(".header").render())

    async def second_run():
        app = StatechatApp(config, tmp_path, loaded=loaded)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            assert shows_thought(views(app)[1])
            await pilot.press("shift+tab", "left_square_bracket")
            await pilot.pause(0.1)
            assert "1/2" in str(views(app)[1].query_one(".header").render())
            assert shows_thought(views(app)[1])
            await send(pilot, app, "plain")  # (this app's template opens no reasoning)
            assert not shows_thought(views(app)[-1])

    asyncio.run(first_run())
    asyncio.run(second_run())


@pytest.mark.parametrize("size", [(40, 12), (18, 6)])
def test_a_small_terminal_leaves_room_for_the_messages(loaded, tmp_path, size):
    """The banner filled a 40x12 terminal's main column, and the chat list, 28 columns, an
    18-column one; on a narrow terminal the list shows while focused (Ctrl+L)."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=size) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            chat, composer = app.query_one(ChatView), app.query_one(Composer)
            assert chat.size.height >= 3 and chat.size.width >= size[0] - 4
            assert composer.size.width >= size[0] - 4
            reply = views(app)[-1]
            assert chat.region.overlaps(reply.region)  # the reply is on screen
            chats = app.query_one(ConversationList)
            await pilot.press("ctrl+l")
            assert chats.display and app.focused is chats
            await pilot.press("ctrl+o")
            assert not chats.display and app.focused is composer

    asyncio.run(run())


def focus_name(app) -> str:
    """What has focus, and that it shows: 'list', 'box' or a message's role."""
    focused = app.focused
    assert all(node.display for node in focused.ancestors_with_self), f"{focused} is hidden"
    if isinstance(focused, ConversationList):
        return "list"
    return "box" if isinstance(focused, Composer) else focused.message.role


@pytest.mark.parametrize("size", [(120, 40), (49, 20), (40, 12)])
def test_tab_leaves_the_chat_list_on_a_narrow_terminal(loaded, tmp_path, size):
    """Below 50 columns the chat list, focused, fills the terminal and the chat is hidden, so
    Tab and Shift+Tab found nothing else to focus: only Enter or Ctrl+O left the list. They
    now go round the list, the messages and the box as on a wide terminal, each part shown
    as soon as it has focus."""

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=size) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            for key, order in (
                ("tab", ["user", "assistant", "box", "list"]),
                ("shift+tab", ["box", "assistant", "user", "list"]),
            ):
                await pilot.press("ctrl+l")
                seen = []
                for _ in order:
                    await pilot.press(key)
                    seen.append(focus_name(app))
                assert seen == order, key
            await pilot.press("ctrl+l")
            app.action_focus_next()  # (shown at once, before the list's blur is handled)
            assert focus_name(app) == "user"

    asyncio.run(run())


# a round trip as QA's (30x8 and back), then ever smaller terminals and back
RESIZES = [(30, 8), (120, 40), (18, 6), (10, 4), (3, 12), (1, 1), (120, 40)]


async def chat_laid_out(pilot, app, timeout: float = 10) -> bool:
    """Whether, within `timeout`, the messages are on screen and the box wider than 40 columns
    (the layout at the last size: a loaded machine draws it some frames after a pause)."""
    chat, composer = app.query_one(ChatView), app.query_one(Composer)
    end = time.monotonic() + timeout
    while True:
        if (all(chat.region.overlaps(v.region) for v in views(app))
                and composer.size.width > 40):
            return True
        if time.monotonic() > end:
            return False
        await pilot.pause(0.02)


def test_resizing_through_tiny_terminals_keeps_the_chat(loaded, tmp_path):
    """Growing a 30x8 terminal back crashed the app: the chat list came back 28 columns wide
    while the screen was still 30, so the box had no column for its placeholder. Here the box
    is empty (its placeholder shows), then holds a draft."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            composer = app.query_one(Composer)
            for draft in ("", "a draft\nof two lines"):
                composer.set_text(draft)
                for _ in range(2):
                    for size in RESIZES:
                        await pilot.resize_terminal(*size)
                        await pilot.pause(0.05)
                        assert app.is_running, f"the app died at {size}"
                shown = views(app)
                assert len(shown) == 2 and shown[0].message.content == "hello"
                assert await chat_laid_out(pilot, app) and composer.text == draft

    asyncio.run(run())


def test_the_focused_message_stands_out(loaded, tmp_path):
    """A focused message's bar had the colour of a user message's ($warning and $accent are one
    orange), its background only a shade lighter (the same in 256 colours): which of your
    messages `e` would edit could not be seen."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "one")
            await send(pilot, app, "two")
            await pilot.press("shift+tab", "up", "up", "up")
            user, other_user, reply = views(app)[0], views(app)[2], views(app)[1]
            assert app.focused is user
            bars = {v: v.styles.border_left[1] for v in (user, other_user, reply)}
            assert bars[user] not in (bars[other_user], bars[reply])
            await pilot.press("down")
            assert reply.styles.border_left[1] not in (bars[other_user], bars[reply])

    asyncio.run(run())


def shown_text(widget) -> str:
    """The text `widget` shows in its region, row by row."""
    rows = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join("".join(segment.text for segment in row) for row in rows)


@pytest.mark.parametrize("width", [64, 36])
def test_every_link_of_a_message_shows_on_a_narrow_terminal(loaded, tmp_path, width):
    """A message's header was one row, cut at the chat's width: under 80 columns a reply's
    `continue` and `delete` links (and on fewer, its `‹ 2/2 ›`) were not on the screen to
    click. The header wraps to the rows it needs."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(width, 40)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            await pilot.press("shift+tab", "c")
            await wait_idle(pilot, app)
            header = views(app)[1].query_one(".header")
            text = " ".join(shown_text(header).split())
            for link in ("‹ 2/2 ›", "regenerate", "continue", "delete"):
                assert link in text, (link, text)
            for _ in range(2):  # (the first click asks)
                await pilot.click(header, offset=_offset_of(header, "delete"))
            await pilot.pause(0.1)
            assert "2/2" not in " ".join(shown_text(views(app)[1].query_one(".header")).split())

    asyncio.run(run())


def _offset_of(widget, word: str) -> tuple[int, int]:
    """Where `word` begins in `widget`'s shown text (x, y)."""
    rows = shown_text(widget).split("\n")
    y = next(i for i, row in enumerate(rows) if word in row)
    return rows[y].index(word) + 1, y


def test_no_control_character_of_a_model_path_or_a_stored_error_reaches_the_terminal(
        loaded, tmp_path):
    """The header named a Hugging Face cache snapshot by its commit hash (`--model ORG/NAME`
    or the default model), and put a folder's escape sequences on the terminal raw; so did a
    reply's stored error in its status line (a row another program wrote)."""
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3.5-0.8B" / "snapshots" / "0123abc"
    escaped = tmp_path / "\x1b[2Jcleared"
    chats = open_chats(tmp_path / "chats")
    conv = chats.create("a chat")
    asked = chats.add(conv.id, None, "user", "hello")
    chats.add(conv.id, asked.id, "assistant", "", stats={"error": "\x1b]0;title\x07failed"})
    chats.close()

    async def run(path):
        app = StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), tmp_path / "chats",
                           loaded=dataclasses.replace(loaded, path=path), sampling=PARAMS)
        async with app.run_test(size=(100, 20)) as pilot:
            await wait_ready(pilot, app)
            lines = screen_lines(app)
            assert status(views(app)[1]) == "error: ·]0;title·failed"
            assert not [line for line in lines if any(ord(c) < 32 for c in line)]
            return app.sub_title

    assert asyncio.run(run(snapshot)).startswith("Qwen/Qwen3.5-0.8B on cpu · ")
    assert asyncio.run(run(escaped)).startswith("·[2Jcleared on cpu · ")
