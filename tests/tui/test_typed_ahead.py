"""Keys typed ahead from a focused message (a burst the terminal sends at once: fast typing, or
keys pressed while the app was busy) go where the keys before them moved the focus: Ctrl+O or
Ctrl+N then text puts the text in the box (it was lost: Textual had handed every key of the
burst to the message), and ] then e edits the message the switch focused."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from textual import events

from statechat.tui.app import StatechatApp
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.message_view import MessageView
from tests.tui.test_app import make_app, settled, views, wait_ready
from tests.tui.test_branch_switch import branched_chat
from tests.tui.test_slow_build import type_keys, until


@pytest.mark.parametrize("first", ["ctrl+o", "ctrl+n"])
def test_text_typed_after_a_key_that_focuses_the_box_lands_in_it(loaded, tmp_path, first):
    branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            views(app)[-1].focus()
            await pilot.pause()
            type_keys(app, first, *"a great read")  # (r, e, d, a: keys of a message too)
            await settled(pilot, app)
            assert app.focused is app.query_one(Composer)
            assert app.query_one(Composer).text == "a great read"
            assert app.handle is None and not app._notifications
            app.exit()

    asyncio.run(run())


def test_text_typed_as_the_box_takes_the_focus_keeps_its_order(loaded, tmp_path, monkeypatch):
    """Ctrl+O then text, the last of it coming from the terminal just as Ctrl+O focuses the
    box, before the text typed before it has gone through: the box holds the text in the order
    it was typed (the later keys went straight to the box, ahead of those sent on from the
    message: ' worldhello')."""
    branched_chat(tmp_path)
    focus_input = StatechatApp.action_focus_input

    def focus_input_then_type(app) -> None:
        focus_input(app)
        for char in " world":  # (as the driver posts them: to the app, now)
            app.post_message(events.Key("space" if char == " " else char, char))

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            views(app)[-1].focus()
            await pilot.pause()
            monkeypatch.setattr(StatechatApp, "action_focus_input", focus_input_then_type)
            type_keys(app, "ctrl+o", *"hello")
            await until(lambda: app.query_one(Composer).text.count("o") == 2, "the text")
            await settled(pilot, app)
            assert app.query_one(Composer).text == "hello world"
            app.exit()

    asyncio.run(run())


def test_a_key_typed_after_a_switch_acts_on_the_message_it_focused(loaded, tmp_path):
    ids = branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            app.query_one(ChatView).view_of(ids["first"]).focus()
            await pilot.pause()
            type_keys(app, "]", "e")
            await settled(pilot, app)
            composer = app.query_one(Composer)
            assert composer.editing == views(app)[0].message.id != ids["first"]
            assert composer.text == views(app)[0].message.content
            app.exit()

    asyncio.run(run())


def test_a_chat_shown_anew_while_a_message_is_focused_focuses_the_box(loaded, tmp_path):
    """Another chat shown while a message has focus (as when another statechat deleted the
    message a key was for): the box takes the focus, not the chat list, where Delete deletes
    a chat and which a narrow terminal shows in place of the chat."""
    ids = branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            app.query_one(ChatView).view_of(ids["first"]).focus()
            await pilot.pause()
            app.open_conversation(ids["other"])
            await settled(pilot, app)
            assert app.focused is app.query_one(Composer)
            app.exit()

    asyncio.run(run())



def where_keys_went(app) -> dict:
    """Where the keys typed went, as the user sees it: the part focused (a message by its
    place), the box's text, the message it edits (by its place), the text an edit put aside,
    the open chat ("conv" or "other") and the chat list's highlight."""
    focused, composer, shown = app.focused, app.query_one(Composer), views(app)
    ids = [v.message.id for v in shown]
    return {"focus": shown.index(focused) if focused in shown else type(focused).__name__,
            "text": composer.text,
            "edits": ids.index(composer.editing) if composer.editing in ids else None,
            "draft": composer.draft, "chat": app.query_one(ConversationList).conv_ids.index(
                app.conv_id), "listed": app.query_one(ConversationList).index}


TURN = "user turn {}: **bold** and `code`"  # (branched_chat's texts)


@pytest.mark.parametrize(("keys", "expected"), [
    (["shift+tab", "up", "e"],  # (e was typed into the box)
     {"focus": "Composer", "edits": 22, "text": TURN.format(22), "draft": ""}),
    ([*"hi", "shift+tab", "up", "e", *"xy"],  # (the edit put hi aside; xy typed into it)
     {"focus": "Composer", "edits": 22, "text": TURN.format(22) + "xy", "draft": "hi"}),
    (["shift+tab", "up", "e", "escape", "shift+tab", "up", "up", "up", "e"],
     {"focus": "Composer", "edits": 20, "text": TURN.format(20)}),
    (["ctrl+l", "down", "x"],  # (down and x went to the box)
     {"focus": "ConversationList", "listed": 1, "text": "", "chat": 0}),
    (["tab", "down", "enter", *"ok"],  # (the list's Enter opens the other chat, box focused)
     {"focus": "Composer", "chat": 1, "text": "ok"}),
    (["ctrl+l", "tab", "down", "down", "e"],  # (the list, then the chat's first message)
     {"focus": "Composer", "edits": 2, "text": TURN.format(2)}),
])
def test_keys_typed_after_a_key_that_moves_the_focus_from_the_box_go_where_it_went(
        loaded, tmp_path, keys, expected):
    """Keys typed fast from the box (a burst the terminal sends at once) after Shift+Tab, Tab
    or Ctrl+L: each goes where the keys before it moved the focus, none lost, in order
    (Textual sent the whole burst to the box before the first key moved the focus: e was
    typed into it rather than editing the message Shift+Tab, Up focused)."""
    branched_chat(tmp_path)

    def seen(app) -> dict:
        return {k: v for k, v in where_keys_went(app).items() if k in expected}

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            app.query_one(Composer).focus()
            await pilot.pause()
            type_keys(app, *keys)
            with contextlib.suppress(AssertionError):  # (the state compared below)
                await until(lambda: seen(app) == expected, "the keys' effect", timeout=20)
            await settled(pilot, app)
            await pilot.pause()
            assert seen(app) == expected
            app.exit()

    asyncio.run(run())


def test_keys_typed_after_a_key_whose_message_went_away_still_act(loaded, tmp_path,
                                                                  monkeypatch):
    """A key handed to a message's view that goes away before the key has come back through
    it (its view replaced as a reply ended, say: the view handles no more messages, and those
    it had would bubble no further): the keys typed after it still act, in order."""
    branched_chat(tmp_path)

    def gone(view, message) -> None:  # (the message the app sends behind each key)
        message.stop()
        view.remove()

    monkeypatch.setattr(MessageView, "on_key_done", gone, raising=False)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            views(app)[-1].focus()
            await pilot.pause()
            type_keys(app, "x", "ctrl+o", *"hi")
            await until(lambda: app.query_one(Composer).text == "hi", "the text typed")
            assert app.focused is app.query_one(Composer)
            app.exit()

    asyncio.run(run())
