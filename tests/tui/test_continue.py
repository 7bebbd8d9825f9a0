"""Continuing a reply (c, or its `continue` link): a new sibling reply that begins with the old
reply's text and goes on from it, the old one kept as another branch. The model is given the
reply as it was made (its own token ids after its own prompt, without the end-of-turn marker a
reply that ended of itself has), so the prompt resumes from the checkpoint at the reply's end,
also after a restart; a thinking model's reasoning is fed back, not dropped as the template
drops it from earlier turns; a reply that ended inside a character goes on from that
character's bytes. One that adds nothing (the reply was complete) is not kept. It is
refused while a reply streams, says so past the context limit, and Esc keeps it as a stopped
reply."""

from __future__ import annotations

import asyncio
import time

from rich.console import Console

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.engine.sampling import SamplingParams
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from tests.helpers import BLOCK, THINKING, with_template
from tests.tui.test_app import (
    header,
    long_text,
    press_quit,
    send,
    settled,
    status,
    views,
    wait_idle,
    wait_ready,
)
from tests.tui.test_edge_cases import focus_message, notices, start_long_reply

# a reply long enough that its end's checkpoint lies blocks past its prompt's
REPLY = SamplingParams(max_tokens=150, ignore_eos=True)
LONG_REPLY = SamplingParams(max_tokens=4000, ignore_eos=True)
EOS = 2  # the embedded model's end of turn, <|im_end|>
ENDS = SamplingParams(max_tokens=64, min_tokens=5, logit_bias={EOS: 100})  # (5, then EOS)


def app_with(loaded, chat_dir, sampling=REPLY, **config) -> StatechatApp:
    return StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu", **config), chat_dir,
                        loaded=loaded, sampling=sampling)


def record_requests(app) -> list:
    """The app's requests from now on (their handles: what the engine was given is their
    output's prompt_token_ids), the next turn's warm-ups left out."""
    handles, submit = [], app.worker.submit

    def recorded(*args, **kwargs):
        handle = submit(*args, **kwargs)
        if handle.request_id != "next-turn":
            handles.append(handle)
        return handle

    app.worker.submit = recorded
    return handles


def reply_end(prompt: list[int], reply: list[int]) -> int:
    """The checkpoint a reply leaves at its end: the last block boundary its fed tokens reach
    (its last token is sampled, never fed)."""
    return (len(prompt) + len(reply) - 1) // BLOCK * BLOCK


async def send_ended(pilot, app) -> list:
    """Once the app is ready, send a message whose reply ends of itself (ENDS); the requests
    recorded from before it (record_requests)."""
    await wait_ready(pilot, app)
    requests = record_requests(app)
    await send(pilot, app, "hello there")
    return requests


async def press_c(pilot, app, index: int = 1) -> None:
    await focus_message(pilot, app, index)
    await pilot.press("c")
    await wait_idle(pilot, app)


def test_continue_goes_on_from_the_reply_as_made(loaded, tmp_path, monkeypatch):
    shown: list[tuple[str, str]] = []
    real_show = StatechatApp._show_text
    monkeypatch.setattr(StatechatApp, "_show_text",
                        lambda self, rid, text: (shown.append((rid, text)),
                                                 real_show(self, rid, text)))

    async def run():
        app = app_with(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            requests = record_requests(app)
            await send(pilot, app, "hello there")
            first = requests[0].output
            old = views(app)[1].message
            assert "continue" in header(views(app)[1])  # (the link, once the reply ended)
            await press_c(pilot, app)
            new = views(app)[1].message
            # a sibling, focused, that begins with the old text and goes on; the old one stays
            assert [m.id for m in app.chats.siblings(new.id)] == [old.id, new.id]
            assert "2/2" in header(views(app)[1]) and app.focused is views(app)[1]
            assert new.content.startswith(old.content) and len(new.content) > len(old.content)
            assert app.chats.message(old.id).content == old.content
            streamed = [text for rid, text in shown if rid == new.id]
            assert streamed and all(text.startswith(old.content) for text in streamed)
            # the engine was given the reply's prompt and the reply's own ids, no end of turn
            prompt = requests[1].output.prompt_token_ids
            assert prompt == first.prompt_token_ids + first.token_ids
            tokenizer = app.worker.engine.tokenizer
            made = prompt[len(first.prompt_token_ids):]
            assert tokenizer.decode(made, skip_special_tokens=True) == old.content
            # it resumed at the old reply's end, past its prompt's checkpoint
            stats = new.stats
            assert stats["prompt_tokens"] == len(prompt)
            assert stats["cached_tokens"] == reply_end(first.prompt_token_ids, first.token_ids)
            assert stats["cached_tokens"] > len(first.prompt_token_ids)
            assert stats["completion_tokens"] == REPLY.max_tokens
            line = status(views(app)[1])
            assert f"150 tokens more ({150 + len(first.token_ids)} in all)" in line
            assert f"reused {stats['cached_tokens']:,} of {len(prompt):,}" in line
            # its ids kept: a continuation of the continuation resumes at its end
            assert app.chats.token_ids(new.id) == first.token_ids + requests[1].output.token_ids
            await press_c(pilot, app)
            assert requests[2].output.prompt_token_ids == prompt + requests[1].output.token_ids
            assert views(app)[1].message.stats["cached_tokens"] == reply_end(
                prompt, requests[1].output.token_ids)
            # the link does what c does
            text = header(views(app)[1])
            link = (text.index("continue") + 2, 0)
            await pilot.click(views(app)[1].query_one(".header"), offset=link)
            await wait_idle(pilot, app)
            assert "4/4" in header(views(app)[1]) and len(requests) == 4

    asyncio.run(run())


def test_a_reply_that_ended_of_itself_is_continued_without_its_end_of_turn(loaded, tmp_path):
    """A reply that ended on <|im_end|> has that id among those it was made of; a continuation
    is given the reply without it (fed back, it closes the turn the model is to go on with)."""
    async def run():
        app = app_with(loaded, tmp_path, sampling=ENDS)
        async with app.run_test(size=(120, 50)) as pilot:
            requests = await send_ended(pilot, app)
            first = requests[0].output
            assert first.finish_reason == "stop" and first.token_ids[-1] == EOS
            old = views(app)[1].message
            assert app.chats.token_ids(old.id) == first.token_ids[:-1]
            await press_c(pilot, app)
            prompt = requests[1].output.prompt_token_ids
            assert prompt == first.prompt_token_ids + first.token_ids[:-1]
            assert EOS not in prompt[len(first.prompt_token_ids):]
            assert views(app)[1].message.content.startswith(old.content)
            assert "2/2" in header(views(app)[1])

    asyncio.run(run())


def test_a_continuation_that_adds_nothing_is_not_kept(loaded, tmp_path):
    """A reply that ended of itself is usually complete: its continuation ends at once, on
    <|im_end|>. No sibling with the same text is kept: the reply continued is shown again,
    focused, its status line as it was, and one notice says nothing was added."""
    async def run():
        app = app_with(loaded, tmp_path, sampling=ENDS)
        async with app.run_test(size=(120, 50)) as pilot:
            requests = await send_ended(pilot, app)
            old = views(app)[1].message
            line = status(views(app)[1])
            app.sampling = SamplingParams(max_tokens=64, logit_bias={EOS: 100})  # (EOS at once)
            await press_c(pilot, app)
            assert requests[1].output.token_ids == [EOS]  # (it ran, and ended at once)
            assert [m.id for m in app.chats.siblings(old.id)] == [old.id]
            assert [v.message.id for v in views(app)] == [m.id for m in app.chats.branch(
                app.conv_id)] and views(app)[1].message.id == old.id
            # (the chat is shown again, and its reply focused, once the screen has redrawn: on
            # a loaded machine that can come some frames after the reply ended)
            end = time.monotonic() + 10
            while app.focused is not views(app)[1] and time.monotonic() < end:
                await pilot.pause(0.05)
            assert app.focused is views(app)[1] and "1/" not in header(views(app)[1])
            assert status(views(app)[1]) == line and app.handle is None
            assert notices(app)[-1] == "The reply is already complete: nothing was added."
            await pilot.press("c")  # (again: the same, nothing piles up)
            await wait_idle(pilot, app)
            assert [m.id for m in app.chats.siblings(old.id)] == [old.id]

    asyncio.run(run())


def test_continue_is_refused_while_a_reply_streams_and_esc_keeps_it(loaded, tmp_path):
    async def run():
        app = app_with(loaded, tmp_path, sampling=LONG_REPLY)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            await pilot.press("escape")  # a reply stopped: the one a user would continue
            await wait_idle(pilot, app)
            old = views(app)[1].message
            assert "stopped" in status(views(app)[1]) and old.content
            await focus_message(pilot, app, 0)
            await pilot.press("c")  # (a message of the user's: nothing to continue)
            assert any("Pick a reply" in n for n in notices(app)) and app.handle is None
            await focus_message(pilot, app, 1)
            await pilot.press("c")
            await pilot.pause(0.3)
            assert app.handle is not None
            new_id = app.streaming_reply_id
            await pilot.press("c")  # refused while it streams, as r is
            assert any("streaming" in n and "Esc" in n for n in notices(app))
            assert len(app.chats.siblings(old.id)) == 2
            await pilot.press("escape")
            await wait_idle(pilot, app)
            new = app.chats.message(new_id)
            assert new.content.startswith(old.content) and len(new.content) > len(old.content)
            assert views(app)[1].message.id == new_id and "2/2" in header(views(app)[1])
            assert "stopped" in status(views(app)[1]) and "tokens more" in status(views(app)[1])
            assert new.stats["completion_tokens"] < LONG_REPLY.max_tokens
            assert app.chats.message(old.id).content == old.content
            tokenizer = app.worker.engine.tokenizer
            ids = app.chats.token_ids(new_id)  # (kept: the text as made)
            assert ids[:len(app.chats.token_ids(old.id))] == app.chats.token_ids(old.id)
            assert tokenizer.decode(ids, skip_special_tokens=True) == new.content

    asyncio.run(run())


def test_quitting_while_a_continuation_streams_keeps_all_of_it(loaded, tmp_path):
    """Ctrl+Q keeps a streaming continuation as Esc does: the reply it continues and what it
    added (the engine's text alone is only the added part), with its ids."""
    async def first_run():
        app = app_with(loaded, tmp_path, sampling=LONG_REPLY)
        async with app.run_test(size=(120, 50)) as pilot:
            await start_long_reply(pilot, app)
            await pilot.press("escape")
            await wait_idle(pilot, app)
            await focus_message(pilot, app, 1)
            await pilot.press("c")
            old, new_id = views(app)[1].message.content, None
            while new_id is None or views(app)[1].text == old:  # (some of it shown)
                new_id = app.streaming_reply_id
                await pilot.pause(0.05)
            await press_quit(pilot)
        return old, new_id

    async def second_run(old, new_id):
        app = app_with(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            new = app.chats.message(new_id)
            assert new.content.startswith(old) and len(new.content) > len(old)
            assert views(app)[1].message.id == new_id and "2/2" in header(views(app)[1])
            assert "stopped" in status(views(app)[1]) and "tokens more" in status(views(app)[1])
            tokenizer = app.worker.engine.tokenizer
            ids = app.chats.token_ids(new_id)
            assert tokenizer.decode(ids, skip_special_tokens=True) == new.content

    asyncio.run(second_run(*asyncio.run(first_run())))


def test_a_continuation_is_there_after_a_restart_and_resumes_from_disk(loaded, tmp_path):
    async def first_run():
        app = app_with(loaded, tmp_path, cache_dir=tmp_path)  # (as `run` has it)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello there")
            await press_c(pilot, app)
            shown = [(v.message.id, v.message.content) for v in views(app)]
            await press_quit(pilot)
        return shown

    async def second_run(before):
        app = app_with(loaded, tmp_path, cache_dir=tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            assert [(v.message.id, v.message.content) for v in views(app)] == before
            assert "2/2" in header(views(app)[1]) and "tokens more" in status(views(app)[1])
            requests = record_requests(app)
            await press_c(pilot, app)
            prompt = requests[0].output.prompt_token_ids
            kept = app.chats.token_ids(before[1][0])
            assert prompt[-len(kept):] == kept
            stats = views(app)[1].message.stats
            assert "3/3" in header(views(app)[1]) and stats["reused_from"] == "disk"
            assert stats["cached_tokens"] == reply_end(prompt[:-len(kept)], kept)
            await focus_message(pilot, app, 1)
            await pilot.press("left_square_bracket", "left_square_bracket")  # the first reply
            await settled(pilot, app)
            assert "1/3" in header(views(app)[1])
            assert before[1][1].startswith(views(app)[1].message.content)

    before = asyncio.run(first_run())
    asyncio.run(second_run(before))


def test_a_reply_that_ended_inside_a_character_is_continued_from_its_own_ids(loaded, tmp_path):
    """The embedded model's reply to this message ends of itself (<|endoftext|>) just after a
    byte that makes no character, shown as U+FFFD. Its continuation is given all of the reply's
    ids, that byte's too: the model ends again at once, and the reply is complete. (It was given
    the ids before that byte, made the byte and the end again, and a branch that repeated the
    reply was kept: "2 tokens more (92 in all)".)"""
    async def run():
        app = app_with(loaded, tmp_path, sampling=SamplingParams(max_tokens=1024),
                       max_model_len=128)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            requests = record_requests(app)
            await send(pilot, app, "fill it up please")
            first, old = requests[0].output, views(app)[1].message
            assert old.content.endswith("\ufffd") and first.finish_reason == "stop"
            await press_c(pilot, app)
            prompt = requests[1].output.prompt_token_ids
            assert prompt == first.prompt_token_ids + first.token_ids[:-1]
            assert [m.id for m in app.chats.siblings(old.id)] == [old.id]
            assert notices(app)[-1] == "The reply is already complete: nothing was added."

    asyncio.run(run())


def test_a_continuation_finishes_the_character_its_reply_ended_inside(loaded, tmp_path):
    """A reply cut inside a character (its first byte, shown as U+FFFD) goes on from that byte:
    the continuation's first token finishes the character, shown whole in place of the U+FFFD,
    and the ids kept with the continuation are the reply's then its own, which decode to its
    text (a continuation of it goes on from them)."""
    async def run():
        app = app_with(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            tokenizer = app.worker.engine.tokenizer
            ids = tokenizer.encode("café au", add_special_tokens=False)
            chats = open_chats(tmp_path)
            conv = chats.create("hello")
            user = chats.add(conv.id, None, "user", "hello")
            old = chats.add(conv.id, user.id, "assistant", "")
            chats.update(old.id, content="caf\ufffd", token_ids=ids[:4])
            chats.close()
            app.open_conversation(conv.id)
            await pilot.pause()
            requests = record_requests(app)
            app.sampling = SamplingParams(max_tokens=1, logit_bias={ids[4]: 100})  # (é's end)
            await press_c(pilot, app)
            assert requests[0].output.prompt_token_ids[-4:] == ids[:4]
            new = views(app)[1].message
            assert "2/2" in header(views(app)[1]) and new.content == "café"
            assert app.chats.token_ids(new.id) == ids[:5]

    asyncio.run(run())


def test_a_continuation_past_the_context_limit_says_so(loaded, tmp_path):
    """A reply whose prompt and text fill the context has no room to go on: the continuation
    is a reply whose status says so and what to do, as a regenerate's would be."""
    async def run():
        app = app_with(loaded, tmp_path, max_model_len=256)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            chats = open_chats(tmp_path)  # (a reply longer than the context: 200 words)
            conv = chats.create("hello")
            user = chats.add(conv.id, None, "user", "hello")
            old = chats.add(conv.id, user.id, "assistant", long_text(7, n=200))
            chats.close()
            app.open_conversation(conv.id)
            await pilot.pause()
            await press_c(pilot, app)
            reply = views(app)[1]
            assert "2/2" in header(reply) and app.handle is None
            assert "context limit is 256" in status(reply) and "Ctrl+N" in status(reply)
            assert app.chats.message(old.id).content == long_text(7, n=200)
            await focus_message(pilot, app, 1)
            await pilot.press("left_square_bracket", "c")  # (the old reply, continued again)
            await wait_idle(pilot, app)
            assert "3/3" in header(views(app)[1])

    asyncio.run(run())


def test_a_thinking_reply_is_continued_with_its_reasoning(loaded, tmp_path):
    """Qwen3.5's template drops an assistant message's reasoning (and its template's own
    continuation cannot find the reply's text once it has): the prompt is the reply's own
    prompt, which opens `<think>`, and then the whole reply; the continuation shows the
    reasoning dimmed, then the answer."""
    reply_text = "first look at the state.</think>\n\nThe answer is"

    async def run():
        app = app_with(with_template(loaded, THINKING), tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await wait_ready(pilot, app)
            chats = open_chats(tmp_path)  # (a reply made before ids were kept: its text only)
            conv = chats.create("why")
            user = chats.add(conv.id, None, "user", "why?")
            chats.add(conv.id, user.id, "assistant", reply_text, stats={"ttft_s": 0.1})
            chats.close()
            app.open_conversation(conv.id)
            await pilot.pause()
            requests = record_requests(app)
            await press_c(pilot, app)
            tokenizer = app.worker.engine.tokenizer
            assert tokenizer.decode(requests[0].output.prompt_token_ids) == (
                "<|im_start|>user\nwhy?<|im_end|>\n<|im_start|>assistant\n<think>\n" + reply_text)
            view = views(app)[1]
            assert view.message.content.startswith(reply_text)
            console = Console(width=100, record=True)
            console.print(view._body())
            screen = console.export_text()
            assert (screen.index("thinking: first look at the state.")
                    < screen.index("The answer is"))
            thought = view._body().renderables[0]
            assert thought.plain.startswith("thinking:") and "dim" in str(thought.style)

    asyncio.run(run())
