"""Another `statechat run` on the same cache dir deletes the chat, or the reply, while that
reply streams here: once it ends (Esc, or of itself) the chat is shown as it now is, and says
so (the reply stayed on the screen with no status line, as if it still streamed, and its loss
went unsaid)."""

from __future__ import annotations

import asyncio

from statechat.chat.tree import open_chats
from tests.tui.test_app import settled, status, views, wait_idle
from tests.tui.test_edge_cases import long_reply_app, notices, start_long_reply


def test_a_reply_deleted_while_it_streams_is_not_left_on_screen(loaded, tmp_path):
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await start_long_reply(pilot, app)  # (the first: its branch deleted)
            other = open_chats(tmp_path)
            other.delete_branch(app.streaming_reply_id)
            await pilot.press("escape")
            await wait_idle(pilot, app)
            await settled(pilot, app)
            assert [v.message.role for v in views(app)] == ["user"]
            assert any("deleted by another" in n for n in notices(app))
            app.query_one("Composer").set_text("again")  # (the second: its chat deleted)
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert app.handle is not None and status(views(app)[-1]) == ""
            other.delete_conversation(app.conv_id)
            other.close()
            await pilot.press("escape")
            await wait_idle(pilot, app)
            await settled(pilot, app)
            assert app.conv_id is None and views(app) == []
            assert sum("deleted by another" in n for n in notices(app)) == 2
            app.exit()

    asyncio.run(run())
