"""`statechat run` in a real terminal (tmux): keys are sent, the screen is captured; a message
gets a streamed reply with a status line, and editing the last message reports reuse."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from statechat.chat.tree import open_chats

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]


def unwrap(screen: str) -> str:
    """The screen with each message line joined to the one before it, so that a status line
    the terminal wrapped (a slow machine's longer figures) reads as one line."""
    return re.sub(r"\s*\n│[^│\n]*│ ▎ ", " ", screen)


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


class Tmux:
    def __init__(self, command: str) -> None:
        self.name = f"statechat-test-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "200", "-y", "60",
                        command], check=True)
        subprocess.run(["tmux", "resize-window", "-t", self.name, "-x", "200", "-y", "60"],
                       check=False)

    def keys(self, *keys: str, literal: bool = False) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *(["-l"] if literal else []), *keys],
                       check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], check=True,
                              capture_output=True, text=True).stdout

    def wait_for(self, predicate, timeout: float = 40) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out; the screen was:\n{self.screen()}")

    def keys_until(self, keys: tuple[str, ...], predicate, timeout: float = 40) -> str:
        """Send keys (harmless when repeated) until the screen shows predicate: a key that
        arrives before the widget meant for it has focus goes elsewhere."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.keys(*keys)
            try:
                return self.wait_for(predicate, timeout=2)
            except AssertionError:
                continue
        raise AssertionError(f"timed out; the screen was:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], check=False)


def test_run_in_tmux(tmp_path):
    cmd = (f"{sys.executable} -m statechat.cli run --device cpu --cache-dir {tmp_path}; "
           "echo STATECHAT-EXIT=$?; sleep 30")
    env_cmd = f"cd {os.getcwd()} && env -u COLUMNS -u LINES TERM=xterm-256color {cmd}"
    tmux = Tmux(f"bash -c '{env_cmd}'")
    try:
        tmux.wait_for(lambda s: "Message (Enter sends" in s and "RANDOM weights" in s)
        tmux.keys(words(1, 100), literal=True)
        tmux.keys("Enter")
        tmux.wait_for(lambda s: "TTFT" in s and "no prefix reused" in s)
        # a message of two lines: Ctrl+J (a line feed from the terminal) breaks the line
        tmux.keys(words(2, 50), literal=True)
        tmux.wait_for(lambda s: "Message (Enter sends" not in s)  # typed into the input
        tmux.keys("C-j")
        tmux.keys(words(5, 50), literal=True)
        tmux.keys("Enter")
        tmux.wait_for(lambda s: "prompt tokens from" in unwrap(s) and "Message (Enter sends" in s)
        # edit the last user message: Shift-Tab focuses the last reply, Up the message above it
        tmux.keys("BTab")
        tmux.wait_for(lambda s: "Regenerate" in s)  # a message has focus: its keys are shown
        tmux.keys("Up")
        tmux.keys_until(("e",), lambda s: "editing" in s)  # (until the user message has focus)
        # the input takes focus a moment after it shows "editing" (letters typed before that
        # would reach the message's key bindings): clear it until it shows it is empty (End C-u
        # clears one row of the wrapped text: the message's 4 and some, at once, not one a try)
        tmux.keys_until(("End", "C-u") * 8, lambda s: "Edit the message (Enter makes" in s)
        tmux.keys(words(3, 100), literal=True)
        tmux.wait_for(lambda s: "Edit the message (Enter makes" not in s)  # typed into the input
        tmux.keys("Enter")
        # the edited turn's status line: TTFT and the prefix it reused (from which tier)
        parts = ("TTFT", "reused", "prompt tokens from")
        tmux.wait_for(lambda s: "2/2" in s and all(p in unwrap(s).split("2/2")[-1] for p in parts))
        tmux.keys("C-q")
        tmux.wait_for(lambda s: "STATECHAT-EXIT=0" in s, timeout=20)
    finally:
        tmux.close()
    chats = open_chats(tmp_path)
    try:
        (conv,) = chats.conversations()
        branch = chats.path(conv.current_leaf)
        assert [m.content for m in branch if m.role == "user"] == [words(1, 100), words(3, 100)]
        original = chats.siblings(branch[2].id)[0]  # the two-line message the edit replaced
        assert original.content == words(2, 50) + "\n" + words(5, 50)
    finally:
        chats.close()
