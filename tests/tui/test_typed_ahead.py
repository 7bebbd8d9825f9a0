"""Keys typed ahead from a focused message (a burst the terminal sends at once: fast typing, or
keys pressed while the app was busy) go where the keys before them moved the focus: Ctrl+O or
Ctrl+N then text puts the text in the box (it was lost: Textual had handed every key of the
burst to the message), and ] then e edits the message the switch focused."""

from __future__ import annotations

import asyncio

import pytest
from textual import events

from statechat.tui.app import StatechatApp
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
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
