"""What switching branch costs the terminal app on a long chat (CPU, no model run).

    python3 scripts/bench_tui_switch.py [--messages 300] [--repeats 3]

A chat of `--messages` messages (user and assistant turns, the replies a few lines of
markdown) in a temp chats file, with a second branch at a message near its end (under the
message 10 from the end, two messages) and one near its start (under the 3rd, ten messages).
The app (the embedded random-weight model, never asked for a reply) opens it in Textual's
headless driver at 120x50; each switch is `[` or `]` on the message, timed from the key's
action to the screen refreshed with the new branch (`pilot.pause()` after it). Prints ms per
switch, the median of `--repeats` switches there and back.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from statechat.chat.tree import open_chats
from statechat.config import EngineConfig
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from statechat.tui.app import StatechatApp
from statechat.tui.widgets.chat_view import ChatView

REPLY = ("Here is **turn {i}**:\n\n- a point about the state cache\n- another about blocks\n\n"
         "```python\nprint({i})\n```\n")


def long_chat(chat_dir: Path, num_messages: int) -> tuple[str, str, str]:
    """A chat of `num_messages` messages and two side branches; (its id, the message near its
    end that has a sibling, the one near its start that has one)."""
    chats = open_chats(chat_dir)
    conv = chats.create("long chat")
    main, parent = [], None
    for i in range(num_messages):
        role = "user" if i % 2 == 0 else "assistant"
        text = f"question {i} about prefixes" if role == "user" else REPLY.format(i=i)
        parent = chats.add(conv.id, parent, role, text).id
        main.append(parent)
    near_end, near_start = main[-10], main[2]
    for at, length in ((near_end, 2), (near_start, 10)):
        parent = chats.find(at).parent_id
        for j in range(length):
            role = "user" if j % 2 == 0 else "assistant"
            parent = chats.add(conv.id, parent, role, f"side branch {j}").id
    chats.select(main[-1])  # (the main branch is the one shown)
    chats.close()
    return conv.id, near_end, near_start


def say(line: str) -> None:
    """Print `line` now (to the real stderr: the app's run captures stdout)."""
    print(line, file=sys.__stderr__, flush=True)


async def time_switches(app: StatechatApp, pilot, msg_id: str, repeats: int) -> list[float]:
    """ms of each switch from `msg_id` to its sibling and back, `repeats` times."""
    times = []
    for _ in range(repeats):
        for action in (app.action_next_branch, app.action_prev_branch):
            start = time.perf_counter()
            action(msg_id)
            await pilot.pause()
            times.append((time.perf_counter() - start) * 1000)
            await pilot.wait_for_scheduled_animations()  # (untimed: the next starts settled)
    return times


async def quit_app(pilot) -> None:
    """Quit as Ctrl+Q does (`app.exit`), the close left to `run_test`'s end. Not by
    `pilot.press("ctrl+q")`: Textual's press waits, after the key, for the app's animations to
    complete, and one that the app starts after its loop has ended (the scroll to a message just
    focused, queued before the key) never does, its animator stopped: the bench hung, idle, at
    its end (tests/tui/test_bench_switch.py)."""
    pilot.app.exit()


async def bench(args) -> None:
    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        conv_id, near_end, near_start = long_chat(Path(tmp), args.messages)
        app = StatechatApp(EngineConfig(model=EMBEDDED_MODEL, device="cpu"), Path(tmp),
                           loaded=loaded)
        async with app.run_test(size=(120, 50)) as pilot:
            while app.chats is None or app.screen.id == "loading":
                await pilot.pause(0.05)
            await pilot.pause()
            assert app.conv_id == conv_id
            say(f"{len(app.query_one(ChatView).views())} messages shown")
            for name, at in (("near the end", near_end), ("near the start", near_start)):
                times = await time_switches(app, pilot, at, args.repeats)
                say(f"switch {name}: median {statistics.median(times):.0f} ms "
                      f"({', '.join(f'{t:.0f}' for t in times)})")
            await quit_app(pilot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
