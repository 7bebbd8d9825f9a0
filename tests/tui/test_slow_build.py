"""A busy machine: a message's view is built (its parts composed, its height known) a while after
the chat shows it. Keys pressed meanwhile act where the user meant them (on the message a switch
focused; in the box once the box is focused), and the message focused ends in sight. The views'
build is held back here until the test lets it go (`held_builds`), so that the keys are pressed
while it is under way, however fast or slow the machine."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from textual import events
from textual.widget import Widget

from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.message_view import MessageView
from tests.tui.test_app import make_app, settled, views, wait_ready
from tests.tui.test_branch_switch import branched_chat

KEYS = {"[": "left_square_bracket", "]": "right_square_bracket"}


@contextlib.contextmanager
def held_builds(monkeypatch):
    """While in it, every MessageView mounted waits to be built until the event it yields is
    set."""
    go = asyncio.Event()
    compose = Widget._on_compose

    async def held_compose(self, event) -> None:
        if isinstance(self, MessageView):
            await go.wait()
        await compose(self, event)

    with monkeypatch.context() as patch:
        patch.setattr(Widget, "_on_compose", held_compose)
        yield go
    go.set()


def type_keys(app, *keys: str) -> None:
    """Keys as a terminal sends them: queued at once, none waited for."""
    for key in keys:
        app._driver.send_message(events.Key(KEYS.get(key, key), key if len(key) == 1 else None))


async def until(condition, what: str, timeout: float = 30) -> None:
    """Wait (without waiting for the app's views, which may be held) until `condition()`."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def switched_while_held(pilot, app, go: asyncio.Event, msg_id: str, *then: str) -> None:
    """Press ] on message `msg_id`, then `then` once the switch ran, its new views not built
    yet; then let the build go and wait for it."""
    index = [v.message.id for v in views(app)].index(msg_id)
    views(app)[index].focus()
    await pilot.pause()
    go.clear()
    type_keys(app, "]")
    await until(lambda: views(app)[index].message.id != msg_id, "the switch")
    await asyncio.sleep(0.05)  # (the switch's own focus moves have run)
    type_keys(app, *then)
    await asyncio.sleep(0.05)
    assert not views(app)[-1].is_mounted  # (still held: the keys came during the build)
    go.set()
    await settled(pilot, app)


def test_keys_pressed_while_a_switched_branch_builds_act_on_its_message(loaded, tmp_path,
                                                                       monkeypatch):
    """] then [ on a chat's first message, the [ pressed before the new branch's view is built:
    the [ switches back (it was typed into the message box, and the branch stayed)."""
    ids = branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            with held_builds(monkeypatch) as go:
                await switched_while_held(pilot, app, go, ids["first"], "[")
            assert app.query_one(Composer).text == ""
            assert views(app)[0].message.id == ids["first"]
            assert app.focused is views(app)[0] and app.screen.can_view_entire(app.focused)
            app.exit()

    asyncio.run(run())


def test_the_box_focused_while_a_switched_branch_builds_keeps_the_focus(loaded, tmp_path,
                                                                        monkeypatch):
    """] then Ctrl+O (to type) before the new branch's view is built: the box keeps the focus
    once it is built, and the letters typed after land in it (the focus went to the message,
    whose keys r, d, e then regenerated, asked to delete, edited)."""
    ids = branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            with held_builds(monkeypatch) as go:
                await switched_while_held(pilot, app, go, ids["first"], "ctrl+o")
            type_keys(app, *"red")
            await pilot.pause(0.1)
            await pilot.pause()
            assert app.focused is app.query_one(Composer)
            assert app.query_one(Composer).text == "red" and app.handle is None
            app.exit()

    asyncio.run(run())


@pytest.mark.parametrize(("at", "then"), [
    ("first", []), ("near_end", []), ("near_end", ["down"]), ("near_end", ["up"] * 6)])
def test_a_message_focused_while_its_branch_builds_ends_in_sight(loaded, tmp_path, monkeypatch,
                                                                 at, then):
    """] on a message, and maybe Up or Down, before the new views are built: the message
    focused is in sight once they are."""
    ids = branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            with held_builds(monkeypatch) as go:
                await switched_while_held(pilot, app, go, ids[at], *then)
            assert isinstance(app.focused, MessageView)
            assert app.screen.can_view_entire(app.focused)
            app.exit()

    asyncio.run(run())


def test_a_message_moved_to_while_an_opened_chat_builds_ends_in_sight(loaded, tmp_path,
                                                                     monkeypatch):
    """A chat opened from the list, and Shift+Tab and Up (to a message that ends above the
    screen) pressed before its views are built: the message focused is in sight once they
    are (Up scrolled to it in a chat of no height, and the chat then went to its bottom)."""
    ids = branched_chat(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            app.open_conversation(ids["other"])
            await settled(pilot, app)
            with held_builds(monkeypatch) as go:
                app.open_conversation(ids["conv"])
                type_keys(app, "shift+tab", *["up"] * 9)
                await until(lambda: app.focused is views(app)[-10], "the focus moves")
                assert not views(app)[-1].is_mounted  # (still held)
                go.set()
                await settled(pilot, app)
            assert app.screen.can_view_entire(views(app)[-10])
            app.exit()

    asyncio.run(run())
