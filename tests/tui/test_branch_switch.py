"""A branch switch keeps the views of the messages the two branches share (the same widgets,
not built again: a 300-message chat took 2 s a switch) and shows what a full rebuild of the
chat shows: the same messages, headers, texts and status lines, the same screen. Switches at
the very first message, and to a shorter or a longer branch, too."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from textual.geometry import Region
from textual.widget import Widget

from statechat.chat.tree import open_chats
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.message_view import MessageView
from tests.tui.test_app import (
    header,
    make_app,
    screen_lines,
    settled,
    status,
    views,
    wait_ready,
)

NUM_MESSAGES = 24


def branched_chat(chat_dir) -> dict[str, str]:
    """A chat of NUM_MESSAGES messages with siblings: of its first message (a one-message
    branch), of its 3rd from the end (a branch of five), and another chat; the main branch
    shown. {name: id} of the chat, the other chat, and the messages with siblings."""
    chats = open_chats(chat_dir)
    other = chats.create("other chat")
    chats.add(other.id, None, "user", "elsewhere")
    conv = chats.create("branched")
    main, parent = [], None
    for i in range(NUM_MESSAGES):
        role = "user" if i % 2 == 0 else "assistant"
        parent = chats.add(conv.id, parent, role, f"{role} turn {i}: **bold** and `code`").id
        main.append(parent)
    chats.update(main[1], stats={"ttft_s": 0.05})
    for at, length in ((main[0], 1), (main[-3], 5)):
        parent = chats.find(at).parent_id
        for j in range(length):
            role = "user" if j % 2 == 0 else "assistant"
            parent = chats.add(conv.id, parent, role, f"side {j} under {at}").id
    chats.select(main[-1])
    chats.close()
    return {"conv": conv.id, "other": other.id, "first": main[0], "near_end": main[-3]}


def shown(app) -> list[tuple[str, str, list[str], str]]:
    """What the chat shows: each view's message id, header, text (as drawn) and status line."""
    return [(v.message.id, header(v), drawn(v.query_one(".body")), status(v)) for v in views(app)]


def drawn(widget: Widget) -> list[str]:
    """The rows of `widget` as drawn (text only), off screen too."""
    return ["".join(seg.text for seg in strip)
            for strip in widget.render_lines(Region(0, 0, *widget.size))]


async def switch(pilot, app, msg_id: str, step: int) -> None:
    """Focus `msg_id`'s view and press [ or ] on it; return once the new views are built, the
    chat scrolled to the focused one, and that scroll has ended (the screen is compared with
    another run's: a scroll still under way is not)."""
    app.query_one(ChatView).view_of(msg_id).focus()
    await pilot.pause()
    await pilot.press("right_square_bracket" if step > 0 else "left_square_bracket")
    await settled(pilot, app)


def run_switches(loaded, chat_dir, switches, rebuild: bool = False) -> list[tuple]:
    """The app on `chat_dir`, each of `switches` ((the message's index in the branch shown,
    step)) done in turn: after each, (the views shown, what they show, the screen, the focused
    message's id). With `rebuild`, every view is built again (each view `shows_as` none: the
    app before it kept any), as the oracle."""
    got = []

    async def run():
        app = make_app(loaded, chat_dir)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)  # (the opening scroll, if any, ended)
            got.append((views(app), shown(app), screen_lines(app), None))
            for index, step in switches:
                await switch(pilot, app, views(app)[index].message.id, step)
                got.append((views(app), shown(app), screen_lines(app), app.focused.message.id))
            app.exit()  # (not pilot.press("ctrl+q"): it can wait forever for the scroll to the
            # message just focused, started after the app's loop ended: test_bench_switch.py)

    with pytest.MonkeyPatch.context() as patch:
        if rebuild:
            patch.setattr(MessageView, "shows_as", lambda self, other: False)
        asyncio.run(run())
    return got


def switched(loaded, tmp_path, switches) -> list[tuple]:
    """`run_switches` on a branched chat, each result checked against the oracle's (the same
    switches on a copy of the chat, every view built again): the same messages, drawn the
    same, the same screen, the same message focused."""
    branched_chat(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    got = run_switches(loaded, tmp_path / "a", switches)
    want = run_switches(loaded, tmp_path / "b", switches, rebuild=True)
    for (_, *seen), (_, *expected) in zip(got, want, strict=True):
        assert seen == expected
    return got


def shared(before: list[MessageView], after: list[MessageView]) -> int:
    """How many views begin both lists as the same widgets; asserts none of the rest is."""
    num = 0
    while num < min(len(before), len(after)) and before[num] is after[num]:
        num += 1
    assert not any(v is w for v in after[num:] for w in before)
    return num


def test_switch_near_the_end_keeps_the_shared_views(loaded, tmp_path):
    near_end = NUM_MESSAGES - 3
    (before, *_), (after, got, _, focused) = switched(loaded, tmp_path, [(near_end, 1)])
    assert len(before) == NUM_MESSAGES and len(after) == near_end + 5
    assert shared(before, after) == near_end
    assert focused == after[near_end].message.id and "2/2" in got[near_end][1]
    assert "side 0 under" in "".join(got[near_end][2])


def test_switch_at_the_first_message(loaded, tmp_path):
    (before, *_), (after, got, *_), (back, *_) = switched(loaded, tmp_path, [(0, 1), (0, -1)])
    assert len(after) == 1 and "side 0 under" in "".join(got[0][2])
    assert shared(before, after) == 0 and shared(after, back) == 0
    assert [v.message.id for v in back] == [v.message.id for v in before]


def test_switch_to_a_longer_then_a_shorter_branch(loaded, tmp_path):
    near_end = NUM_MESSAGES - 3
    runs = switched(loaded, tmp_path, [(near_end, 1), (near_end, -1)])
    (before, *_), (longer, *_), (shorter, *_) = runs
    assert (len(before), len(longer), len(shorter)) == (NUM_MESSAGES, near_end + 5, NUM_MESSAGES)
    assert shared(before, longer) == near_end and shared(longer, shorter) == near_end


def test_the_focused_message_is_in_sight_when_views_build_slowly(loaded, tmp_path, monkeypatch):
    """A busy machine: each new view's parts are composed a while after the switch laid the chat
    out. The switch still ends with the focused message on screen (it was focused while the views
    had no height, seemed in sight at the top, and the chat, still anchored, then went to its
    bottom: CI saw it once, as a screen unlike the oracle's)."""
    branched_chat(tmp_path)
    compose = Widget._on_compose

    async def slow_compose(self, event) -> None:
        if isinstance(self, MessageView):
            await asyncio.sleep(0.05)
        await compose(self, event)

    seen = []

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            monkeypatch.setattr(Widget, "_on_compose", slow_compose)
            for index, step in [(0, 1), (0, -1), (NUM_MESSAGES - 3, 1)]:
                await switch(pilot, app, views(app)[index].message.id, step)
                await pilot.pause(0.3)
                seen.append(app.screen.can_view_entire(app.focused))
            app.exit()

    asyncio.run(run())
    assert seen == [True, True, True]
