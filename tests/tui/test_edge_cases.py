"""What a user can do that once crashed the app, lost their text or wrote to the wrong place:
an edit left open while another chat is opened or its message deleted, a message past the
context limit, a multi-line first message (the chat list's title), a pasted first line's
indent, deleting a chat while its reply streams, a chat deleted or gone on with by another
statechat on the same cache dir, a chat on damaged pages of the file, quitting while a reply
streams, and a message sent while the disk is full."""

from __future__ import annotations

import asyncio
import time

import pytest
from textual import events

from statechat.chat.tree import BusyError, DamagedError, open_chats
from statechat.config import EngineConfig
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.format import status_line
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from tests.tui.conftest import rest_between_steps
from tests.tui.test_app import (
    long_text,
    make_app,
    screen_lines,
    send,
    status,
    views,
    wait_idle,
    wait_ready,
)

LONG_REPLY = SamplingParams(max_tokens=4000, ignore_eos=True)


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


def long_reply_app(loaded, chat_dir) -> StatechatApp:
    """An app on `chat_dir` whose replies are long (LONG_REPLY): still streaming when looked at."""
    return StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), chat_dir,
                        loaded=loaded, sampling=LONG_REPLY)


async def start_long_reply(pilot, app) -> None:
    """Once the app is ready, send a message whose reply (LONG_REPLY) is still streaming, the
    engine resting between its tokens (rest_between_steps)."""
    await wait_ready(pilot, app)
    rest_between_steps(app)
    app.query_one(Composer).set_text("a long reply")
    await pilot.press("enter")
    await pilot.pause(0.2)


async def focus_message(pilot, app, index: int) -> None:
    views(app)[index].focus()
    await pilot.pause()


def test_edit_ends_with_its_message_on_screen_and_the_draft_comes_back(loaded, tmp_path):
    """Opening another chat, a new chat or deleting the message ends an edit (it once went
    into the other chat, or crashed on Enter); Esc, Enter and those bring back the draft
    that was in the box before `e`."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            composer = app.query_one(Composer)
            await send(pilot, app, "chat a")
            conv_a = app.conv_id
            await pilot.press("ctrl+n")
            await send(pilot, app, "chat b")
            conv_b = app.conv_id
            # an edit of b's message, then chat a opened from the list: the edit ends
            composer.set_text("a draft")
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            assert composer.editing and composer.text == "chat b"
            app.query_one(ConversationList).post_message(ConversationList.Open(conv_a))
            await pilot.pause(0.1)
            assert app.conv_id == conv_a and composer.editing is None
            assert composer.text == "a draft"
            assert any("edit" in n.lower() for n in notices(app))
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert [m.content for m in app.chats.branch(conv_b)][:1] == ["chat b"]
            assert len(app.chats.siblings(app.chats.branch(conv_b)[0].id)) == 1
            assert ([m.content for m in app.chats.branch(conv_a) if m.role == "user"]
                    == ["chat a", "a draft"])
            # an edit whose message is deleted: Enter no longer crashes, the draft is back
            composer.set_text("second draft")
            await focus_message(pilot, app, 2)
            await pilot.press("e")
            assert composer.text == "a draft"
            await focus_message(pilot, app, 2)
            await pilot.press("d", "d")
            await pilot.pause(0.1)
            assert composer.editing is None and composer.text == "second draft"
            # Esc cancels an edit and brings the draft back; so does sending the edit
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            assert composer.text == "chat a"
            await pilot.press("escape")
            assert composer.editing is None and composer.text == "second draft"
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            composer.set_text("chat a, edited")
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert composer.text == "second draft"
            assert views(app)[0].message.content == "chat a, edited"

    asyncio.run(run())


def test_a_message_past_the_context_limit_is_an_error_on_its_reply(loaded, tmp_path):
    """It crashed the app (the reply's view was not built yet); now the reply says what to do
    and the message is kept."""
    async def run():
        config = EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=256)
        app = StatechatApp(config, tmp_path, loaded=loaded, sampling=SamplingParams(max_tokens=8))
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, long_text(7, n=400))
            user, reply = views(app)
            assert user.message.content == long_text(7, n=400)
            assert "context limit is 256" in status(reply) and "Ctrl+N" in status(reply)
            assert app.handle is None
            await send(pilot, app, "short")  # the app goes on
            assert views(app)[-2].message.content == "short"

    asyncio.run(run())


def test_a_reply_cut_at_the_context_limit_says_so(loaded, tmp_path):
    """A reply that fills the context said `hit max tokens`, though far short of them: the
    user raised --max-tokens, or continued it (c), and got the same reply, or an error. It
    says it hit the context limit; one cut at its max tokens still says that."""
    async def run(max_tokens: int) -> str:
        config = EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=256)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        app = StatechatApp(config, tmp_path / str(max_tokens), loaded=loaded, sampling=sampling)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            stats = views(app)[1].message.stats
            return status(views(app)[1]), stats

    line, stats = asyncio.run(run(4000))
    assert stats["prompt_tokens"] + stats["completion_tokens"] == 256
    assert "hit the context limit (256 tokens)" in line and "max tokens" not in line
    line, stats = asyncio.run(run(8))
    assert stats["completion_tokens"] == 8 and "hit max tokens" in line


def test_streamed_text_for_a_view_not_built_yet(loaded, tmp_path):
    """Opening the chat whose reply streams builds its views anew; text the worker sends
    before they are built (it went to the views being replaced) shows once they are."""
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            app.handle.abort()
            await wait_idle(pilot, app)
            reply_id = views(app)[1].message.id
            app.open_conversation(app.conv_id)
            app._show_text(reply_id, "streamed")  # as the worker's call lands, between the two
            app.query_one(ChatView).view_of(reply_id).set_status("done")
            await pilot.pause()
            assert views(app)[1].query_one(".body").content.markup == "streamed"  # (Markdown)
            assert status(views(app)[1]) == "done"

    asyncio.run(run())


def test_titles_are_one_line_and_a_paste_keeps_its_first_indent(loaded, tmp_path):
    async def run():
        store = open_chats(tmp_path)
        store.create(title="an old\ntitle")  # as earlier versions stored a multi-line message
        store.close()
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            pasted = "    indented()\n        more()\n"
            await pilot.press("ctrl+n")  # (the old chat, empty, is open)
            app.post_message(events.Paste(pasted))
            await pilot.pause()
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert views(app)[0].message.content == "    indented()\n        more()"
            new, _ = app.chats.conversations()
            assert new.title == "indented() more()"
            labels = [str(label.render())
                      for label in app.query_one(ConversationList).query("Label")]
            assert labels == ["indented() more()", "an old title"]

    asyncio.run(run())


def test_a_chat_emptied_by_deletes_is_named_by_its_next_first_message(loaded, tmp_path):
    """Deleting a chat's first message leaves it empty; the next message sent names it, as it
    names a new chat (it kept the deleted message's title for good). An edit of the first
    message, a sibling beside it, leaves the title alone."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first topic")
            await focus_message(pilot, app, 0)
            await pilot.press("d", "d")
            await pilot.pause(0.1)
            assert views(app) == []
            await send(pilot, app, "second\ntopic")
            (chat,) = app.chats.conversations()
            assert chat.title == "second topic"
            labels = [str(label.render())
                      for label in app.query_one(ConversationList).query("Label")]
            assert labels == ["second topic"]
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            app.query_one(Composer).set_text("an edit")
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert app.chats.conversations()[0].title == "second topic"

    asyncio.run(run())


def test_a_streaming_chat_is_not_deleted_from_another_chat(loaded, tmp_path):
    """Deleting it once left its reply generating into a deleted chat (and every send
    refused until it ended); actions refused while a reply streams now say why."""
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            streaming = app.conv_id
            assert app.handle is not None
            await focus_message(pilot, app, 0)
            await pilot.press("d")
            assert len(views(app)) == 2 and any("Esc" in n for n in notices(app))
            await pilot.press("ctrl+n")
            app.query_one(ConversationList).post_message(ConversationList.Delete(streaming))
            await pilot.pause(0.1)
            assert [c.id for c in app.chats.conversations()] == [streaming]
            await pilot.press("escape")
            await wait_idle(pilot, app)
            assert app.chats.branch(streaming)[-1].stats["finish_reason"] == "abort"

    asyncio.run(run())


def test_a_chat_deleted_by_another_process(loaded, tmp_path):
    """Another `statechat run` on the same cache dir deletes a message or the open chat: a key
    on the deleted message, or Enter, says so (they crashed the app, and the typed text was
    lost); the text stays in the box, and Enter again sends it to a new chat."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            await send(pilot, app, "second")
            other = open_chats(tmp_path)
            other.delete_branch(app.chats.branch(app.conv_id)[2].id)
            await focus_message(pilot, app, 3)
            await pilot.press("r")
            await pilot.pause(0.1)
            assert any("another" in n for n in notices(app))
            assert [v.message.content for v in views(app)][:1] == ["first"] and len(views(app)) == 2
            other.delete_conversation(app.conv_id)
            other.close()
            app.query_one(Composer).set_text("still here")
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert app.conv_id is None and app.query_one(Composer).text == "still here"
            assert sum("deleted by another" in n for n in notices(app)) == 2
            await pilot.press("enter")
            await wait_idle(pilot, app)
            (conv,) = app.chats.conversations()
            assert app.chats.branch(conv.id)[0].content == "still here"

    asyncio.run(run())


def test_a_message_deleted_by_another_process_as_the_new_one_is_added(loaded, tmp_path,
                                                                      monkeypatch):
    """The message a new one follows is deleted by another statechat between the app's read
    of the chat and its write (the add raised GoneError, which ended the app): a notice, the
    text stays in the box, and Enter again sends it."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            other, add = open_chats(tmp_path), app.chats.add

            def raced(conv_id, parent_id, *args, **kwargs):
                other.delete_branch(parent_id)  # (just before the write)
                monkeypatch.setattr(app.chats, "add", add)
                return add(conv_id, parent_id, *args, **kwargs)

            monkeypatch.setattr(app.chats, "add", raced)
            app.query_one(Composer).set_text("second")
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert app.is_running and app.query_one(Composer).text == "second"
            assert any("deleted by another" in n for n in notices(app))
            await pilot.press("enter")
            await wait_idle(pilot, app)
            other.close()
            assert [m.content for m in app.chats.branch(app.conv_id)][:1] == ["first"]
            assert "second" in [m.content for m in app.chats.branch(app.conv_id)]

    asyncio.run(run())


def test_a_reply_deleted_by_another_process_as_it_is_saved(loaded, tmp_path, monkeypatch):
    """Another statechat deletes the reply between its save at the end and the app's read of
    it back for the screen (the read raised in the stream's worker: the deleted reply stayed
    on the screen, without its status, and a message sent after it was refused as following
    a deleted one): the chat is shown as it now is, and the next message follows it."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            other, update = open_chats(tmp_path), app.chats.update

            def raced(msg_id, *args, **kwargs):
                saved = update(msg_id, *args, **kwargs)
                if saved and kwargs.get("stats") is not None:  # (the reply's end: gone after)
                    monkeypatch.setattr(app.chats, "update", update)
                    other.delete_branch(msg_id)
                return saved

            monkeypatch.setattr(app.chats, "update", raced)
            await send(pilot, app, "first")
            await pilot.pause(0.1)
            assert [v.message.content for v in views(app)] == ["first"]
            await send(pilot, app, "second")
            other.close()
            assert "second" in [m.content for m in app.chats.branch(app.conv_id)]

    asyncio.run(run())


def test_a_message_follows_what_is_shown_not_what_another_process_added(loaded, tmp_path):
    """Another statechat went on with the open chat: a message sent followed its messages,
    never shown here, so the reply answered a conversation the user had not read. It now
    follows the last message on screen (a branch beside the other's)."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            other = open_chats(tmp_path)
            user = other.add(app.conv_id, views(app)[1].message.id, "user", "not shown here")
            other.add(app.conv_id, user.id, "assistant", "nor this")
            other.close()
            await send(pilot, app, "second")
            assert [v.message.content for v in views(app)][::2] == ["first", "second"]
            assert "2/2" in str(views(app)[2].query_one(".header").render())

    asyncio.run(run())


def test_the_message_box_leaves_a_small_terminal_room_for_the_chat(loaded, tmp_path):
    """The box grows with its lines up to 12 rows, and to a third of a small terminal."""
    async def run(size, rows):
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=size) as pilot:
            await wait_ready(pilot, app)
            composer = app.query_one(Composer)
            composer.set_text("\n".join(f"line {i}" for i in range(30)))
            await pilot.pause()
            assert composer.size.height + 2 == rows  # (the size is inside its border)

    asyncio.run(run((80, 24), 8))
    asyncio.run(run((120, 50), 12))


def test_changed_edits_and_typed_ahead_keys_stay_in_the_box(loaded, tmp_path):
    """An edit whose text was changed is not thrown away when its message leaves the screen
    or another statechat deletes it: the text stays in the box, to send as a new message.
    Keys typed right after Enter, queued before it was handled, stay in the box too."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            composer = app.query_one(Composer)
            await send(pilot, app, "first")
            conv = app.conv_id
            composer.set_text("a draft")
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            composer.set_text("first, edited")
            await pilot.press("ctrl+n")  # a new chat: the edit ends, its changed text stays
            assert composer.editing is None and composer.text == "first, edited"
            assert any("stays in the box" in n for n in notices(app))
            await pilot.press("enter")  # sent: the draft put aside by the edit comes back
            await wait_idle(pilot, app)
            assert composer.text == "a draft" and views(app)[0].message.content == "first, edited"
            composer.clear()
            app.open_conversation(conv)
            await focus_message(pilot, app, 0)
            await pilot.press("e")
            composer.set_text("edited again")
            other = open_chats(tmp_path)
            other.delete_branch(views(app)[0].message.id)
            other.close()
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert composer.editing is None and composer.text == "edited again"
            assert any("message being edited was deleted" in n for n in notices(app))
            await pilot.press("enter")  # sent anew, as a message of its own
            await wait_idle(pilot, app)
            assert ([m.content for m in app.chats.branch(conv) if m.role == "user"]
                    == ["edited again"])
            composer.set_text("hello")
            composer.post_message(events.Key("enter", None))
            composer.post_message(events.Key("x", "x"))  # (handled before the Submitted message)
            await wait_idle(pilot, app)
            assert composer.text == "x" and views(app)[-2].message.content == "hello"
            await focus_message(pilot, app, 2)  # an edit sent with keys typed after its Enter
            await pilot.press("e")
            composer.set_text("hello, edited")
            composer.post_message(events.Key("enter", None))
            composer.post_message(events.Key("y", "y"))
            await wait_idle(pilot, app)
            assert composer.text == "xy" and views(app)[-2].message.content == "hello, edited"

    asyncio.run(run())


@pytest.mark.parametrize("stats", [
    {"error": "the engine failed"},
    {"finish_reason": "abort", "completion_tokens": 0},  # stopped before its first token
    {},  # as a quit while it streamed left it, in earlier versions
])
def test_a_reply_with_no_text_is_left_out_of_later_prompts(loaded, tmp_path, stats):
    """A reply that failed, or ended, before any text was never the model's turn: the next
    prompt goes on from the messages before it (it went in as an empty assistant turn)."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            conv = app.chats.create(title="t")
            first = app.chats.add(conv.id, None, "user", "first")
            app.chats.add(conv.id, first.id, "assistant", "", stats=stats)
            app.open_conversation(conv.id)
            await send(pilot, app, "second")
            prompt = app.worker.render([{"role": "user", "content": "first"},
                                        {"role": "user", "content": "second"}])
            assert views(app)[-1].message.stats["prompt_tokens"] == len(prompt)

    asyncio.run(run())


async def quit_while_streaming(loaded, chat_dir, quit=None) -> StatechatApp:
    """Start a long reply in a new app on `chat_dir`, and once some is shown quit: press
    Ctrl+Q, or await `quit(app)`. The app, closed."""
    app = long_reply_app(loaded, chat_dir)
    async with app.run_test(size=(120, 50)) as pilot:
        await start_long_reply(pilot, app)
        while not views(app)[1].text:  # (some of it shown)
            await pilot.pause(0.05)
        assert app.handle is not None
        await (pilot.press("ctrl+q") if quit is None else quit(app))
    return app


def reply_kept_stopped(app) -> tuple:
    """(An app reopened after a quit while its reply streamed) the branch's user message and
    reply views, the reply checked to be kept as Esc keeps one: its text and 'stopped'."""
    user, reply = views(app)
    assert reply.message.content and reply.text == reply.message.content
    assert "stopped" in status(reply) and reply.message.stats["completion_tokens"] < 4000
    return user, reply


def test_quitting_while_a_reply_streams_keeps_it(loaded, tmp_path):
    """Ctrl+Q while a reply streamed lost it (an empty reply after a restart, which went into
    the next prompt as an empty turn): it is kept as Esc keeps it, its text so far and a
    'stopped' status, and the chat goes on from it."""
    async def second_run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            user, reply = reply_kept_stopped(app)
            await send(pilot, app, "next")
            history = [user.message.as_chat(), reply.message.as_chat(),
                       {"role": "user", "content": "next"}]
            assert views(app)[-1].message.stats["prompt_tokens"] == len(app.worker.render(history))

    asyncio.run(quit_while_streaming(loaded, tmp_path))
    asyncio.run(second_run())


def test_a_chat_on_damaged_pages_ends_the_app_in_one_line(loaded, tmp_path, capsys):
    """A chat whose pages of index.db are damaged (a disk fault): opening it ended the app in
    Textual's traceback. It ends in one line that names the file and says what to do."""
    chats = open_chats(tmp_path)
    damaged = chats.create("damaged")
    parent = None
    for i in range(12):  # (pages of its own)
        parent = chats.add(damaged.id, parent, "user", f"DAMAGED{i} " + "z" * 900).id
    chats.add(chats.create("sound").id, None, "user", "sound")
    chats.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    chats.close()
    data = bytearray((tmp_path / "index.db").read_bytes())
    page = data.index(b"DAMAGED5") // 4096 * 4096
    data[page:page + 4096] = b"\xff" * 4096
    (tmp_path / "index.db").write_bytes(bytes(data))

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            assert views(app)[0].message.content == "sound"
            chat_list = app.query_one(ConversationList)
            chat_list.post_message(ConversationList.Open(damaged.id))  # (Enter on it; a
            # pilot's key would wait for an app that has ended)
            while app.is_running:
                await asyncio.sleep(0.05)
        return app

    assert asyncio.run(run()).return_code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"statechat: the chats in {tmp_path / 'index.db'} are damaged")
    assert "move the file away" in err and "Traceback" not in err
    # (`.recover` alone prints SQL: the line pipes it into a file that can take the index's place)
    index, bare = tmp_path / "index.db", "".join(err.split())  # (the line was wrapped)
    assert f"`sqlite3{index}.recover|sqlite3{index}.recovered`" in bare


def test_a_reply_s_save_on_damaged_pages_ends_the_app_in_one_line(loaded, tmp_path, capsys,
                                                                 monkeypatch):
    """The chats' file found damaged as a reply is saved at its end (in the stream's worker
    thread, which dropped the error unsaid: the app went on with the reply unsaved) ends the
    app in its one line, as anywhere else."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)

            def damaged(*args, **kwargs):
                raise DamagedError(f"the chats in {tmp_path / 'index.db'} are damaged (disk I/O "
                                   "error); move the file away")

            monkeypatch.setattr(app.chats, "update", damaged)
            app.query_one(Composer).set_text("hello")
            await pilot.press("enter")
            for _ in range(600):
                if not app.is_running:
                    break
                await asyncio.sleep(0.05)
        return app

    assert asyncio.run(run()).return_code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"statechat: the chats in {tmp_path / 'index.db'} are damaged")
    assert "Traceback" not in err


def test_a_streaming_reply_is_on_disk_before_it_ends(loaded, tmp_path, monkeypatch):
    """A reply was saved only when it ended: after a kill -9 or a power cut it came back
    empty, with no status, for good. Its text is saved as it streams (unfinished, and the
    status says so, to another statechat or after a restart, not in the app it streams in);
    its end, a stop here, then replaces that."""
    from statechat.tui import replies

    monkeypatch.setattr(replies, "SAVE_INTERVAL_S", 0.05)

    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            reply_id, other = app.streaming_reply_id, open_chats(tmp_path)
            assert other.message(reply_id).stats == {"unfinished": True}  # (from its start)
            for _ in range(200):  # (what another process, or a restart, reads)
                if other.message(reply_id).content:
                    break
                await pilot.pause(0.05)
            saved = other.message(reply_id)
            assert app.handle is not None and saved.content and saved.stats == {"unfinished": True}
            assert status_line(saved.stats).startswith("unfinished")
            app.open_conversation(app.conv_id)  # (this app knows it streams: no such status)
            await pilot.pause(0.1)
            assert app.handle is not None and status(views(app)[1]) == ""
            await pilot.press("escape")
            await wait_idle(pilot, app)
            await pilot.pause(0.2)
            kept = other.message(reply_id)
            assert "stopped" in status_line(kept.stats) and kept.content == views(app)[1].text

    asyncio.run(run())


def test_a_full_disk_keeps_the_message_in_the_box(loaded, tmp_path):
    """A message sent while the chats' file cannot grow (a full disk) ended the app in Textual's
    traceback, the text typed lost. A notice says so, the text stays in the box, and Enter
    sends it once there is room again. The notice names the file as it is (a folder's name that
    read as markup, `[/old]`, ended the app in Textual's MarkupError)."""
    async def run():
        app = make_app(loaded, tmp_path / "[/old]")
        async with app.run_test(size=(120, 50), notifications=True) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            db = app.chats.db
            pages = db.execute("PRAGMA page_count").fetchone()[0]
            db.execute(f"PRAGMA max_page_count = {pages}")  # (SQLite's "database or disk is
            # full", on this connection)
            text = "a long message " * 2000
            app.query_one(Composer).set_text(text)
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert app.is_running and app.query_one(Composer).text == text
            assert any("disk is full" in n for n in notices(app))
            end = time.monotonic() + 10  # (the notice shows: some frames later when loaded)
            while "[/old]" not in " ".join(screen_lines(app)) and time.monotonic() < end:
                await pilot.pause(0.05)
            assert app.is_running and "[/old]" in " ".join(screen_lines(app))
            assert [v.message.content for v in views(app)][:1] == ["first"]
            db.execute("PRAGMA max_page_count = 1073741823")
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert app.query_one(Composer).text == ""
            assert views(app)[2].message.content == text.rstrip()

    asyncio.run(run())


def test_a_reply_that_cannot_be_added_leaves_the_message_sent_on_screen(loaded, tmp_path,
                                                                       monkeypatch):
    """The message was saved but its reply's row could not be (the disk filled, or another
    process took the lock, in between): the message is shown, as it is in the chat, and the
    notice says the reply did not start (it said "Not sent", the message hidden and its text
    gone from the box)."""
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "first")
            add = app.chats.add

            def full_for_replies(conv_id, parent_id, role, *args, **kwargs):
                if role == "assistant":
                    raise BusyError("the chats in X could not be saved (database or disk is "
                                    "full); free some disk space")
                return add(conv_id, parent_id, role, *args, **kwargs)

            monkeypatch.setattr(app.chats, "add", full_for_replies)
            await send(pilot, app, "second")
            assert app.is_running and app.handle is None
            assert [v.message.content for v in views(app)][::2] == ["first", "second"]
            assert not any(n.startswith("Not sent") for n in notices(app)), notices(app)
            assert any("disk is full" in n and "reply" in n for n in notices(app)), notices(app)

    asyncio.run(run())
