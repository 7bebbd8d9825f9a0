"""A delete's question (`Delete this reply? Press d again to delete.`) leaves the screen once it
no longer holds: answered (the branch deleted), or lapsed (the focus moved). It stayed up to
5 s, beside `Branch deleted.`, or over another message then focused, saying to press d again."""

from __future__ import annotations

import asyncio

from tests.tui.test_app import make_app, settled, views, wait_ready
from tests.tui.test_edge_cases import notices
from tests.tui.test_maximize import chat_of_two

QUESTION = "Press d again to delete"


def test_a_delete_question_goes_once_answered_or_lapsed(loaded, tmp_path):
    chat_of_two(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_ready(pilot, app)
            await pilot.press("shift+tab", "d")  # the reply: asked
            await pilot.pause()
            assert any(QUESTION in n for n in notices(app))
            await pilot.press("d")  # answered: deleted
            await settled(pilot, app)
            assert "Branch deleted." in notices(app)
            assert not any(QUESTION in n for n in notices(app))
            assert app.focused is views(app)[0]
            await pilot.press("d")  # the message asked: asked, then the focus moves
            await pilot.pause()
            assert any(QUESTION in n for n in notices(app))
            await pilot.press("ctrl+o")
            await pilot.pause()
            assert not any(QUESTION in n for n in notices(app))
            assert len(views(app)) == 1
            app.exit()

    asyncio.run(run())
