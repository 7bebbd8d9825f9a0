"""Taking a chat out of the app: `y` on a focused message copies its text (a reply's answer,
its reasoning left out) to the clipboard, saying how much; the command palette's `Copy chat`
copies the branch shown as Markdown, and `Export chat` writes it to a new Markdown file in the
current directory, named from the chat's title, never over another file; a directory that
cannot be written is said in one line, and the chat stays as it was."""

from __future__ import annotations

import asyncio
import os

from statechat.chat.transcript import file_name, write_new
from statechat.chat.tree import open_chats
from tests.tui.palette import run_command
from tests.tui.test_app import make_app, views, wait_ready
from tests.tui.test_edge_cases import focus_message, notices

QUESTION = "q" * 1234
MARKDOWN = f"""# Plans: a/b?

**System**:

Be brief.

**User**:

{QUESTION}

**Assistant**:

<details>
<summary>Thinking</summary>

mulling it over

</details>

an **answer**
"""


def seed(chat_dir) -> None:
    """A chat titled "Plans: a/b?": a system message, a question, a reply that reasoned."""
    chats = open_chats(chat_dir)
    conv = chats.create("Plans: a/b?")
    system = chats.add(conv.id, None, "system", "Be brief.")
    asked = chats.add(conv.id, system.id, "user", QUESTION)
    chats.add(conv.id, asked.id, "assistant", "<think>\nmulling it over\n</think>\n\nan **answer**",
              stats={"finish_reason": "stop"})
    chats.close()


def test_y_copies_the_focused_message_and_the_palette_copies_the_chat(loaded, tmp_path):
    seed(tmp_path)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            await focus_message(pilot, app, 1)
            await pilot.press("y")
            assert app.clipboard == QUESTION and notices(app)[-1] == "Copied 1,234 characters."
            await focus_message(pilot, app, 2)
            await pilot.press("y")
            assert app.clipboard == "an **answer**"
            assert notices(app)[-1] == "Copied 13 characters (the answer; its reasoning left out)."
            await run_command(pilot, app, "Copy chat")
            assert app.clipboard == MARKDOWN
            copied = f"Copied the chat as Markdown ({len(MARKDOWN):,} characters)."
            assert notices(app)[-1] == copied
            assert len(views(app)) == 3
            await pilot.press("ctrl+n")
            await run_command(pilot, app, "Copy chat")
            assert notices(app)[-1] == "Nothing to copy: this chat has no messages yet."
            app.exit()

    asyncio.run(run())


def test_export_writes_a_new_markdown_file_each_time(loaded, tmp_path, monkeypatch):
    seed(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_ready(pilot, app)
            await run_command(pilot, app, "Export chat")
            assert notices(app)[-1] == f"Exported the chat to {out / 'Plans-a-b.md'}."
            await run_command(pilot, app, "Export chat")  # (the first file stays as it was)
            assert notices(app)[-1] == f"Exported the chat to {out / 'Plans-a-b-2.md'}."
            gone = tmp_path / "gone"
            gone.mkdir()
            os.chdir(gone)
            gone.rmdir()  # (the current directory deleted under the app)
            await run_command(pilot, app, "Export chat")
            assert notices(app)[-1].startswith("Could not export the chat: ")
            assert "\n" not in notices(app)[-1] and len(views(app)) == 3
            app.exit()

    asyncio.run(run())
    assert sorted(p.name for p in out.iterdir()) == ["Plans-a-b-2.md", "Plans-a-b.md"]
    assert all(p.read_text(encoding="utf-8") == MARKDOWN for p in out.iterdir())


def test_file_names_are_safe_and_never_reuse_a_file(tmp_path):
    """A title becomes a file name with no folders, dots or blanks in it (letters of any
    script kept); a taken name gets -2, -3 ..."""
    assert file_name("../../etc/passwd") == "etc-passwd.md"
    assert file_name("Über Café ☕ 2024!") == "Über-Café-2024.md"
    assert file_name("...") == file_name("") == "chat.md"
    assert len(file_name("x" * 500)) <= 64
    # (a word's combining marks are part of it: Devanagari's vowel signs, an accent typed as a
    # mark of its own; they were cut out, and the words split at each: "नमस-त-द-न-य.md")
    assert file_name("नमस्ते दुनिया") == "नमस्ते-दुनिया.md"
    assert file_name("cafe\u0301 ok") == "café-ok.md"
    (tmp_path / "a.md").write_text("mine")
    assert write_new(tmp_path, "a", "new").name == "a-2.md"
    assert write_new(tmp_path, "a", "newer").name == "a-3.md"
    assert (tmp_path / "a.md").read_text() == "mine"
