"""Keys typed while `statechat run` starts reach the app: in a terminal's cooked mode, before
Textual takes it, Ctrl+Q was eaten by XON/XOFF flow control (the app never saw it and kept
running) and echoed `^Q` over the shell; within `typeahead()` it waits, unechoed, for the app,
and the terminal's settings come back as they were."""

from __future__ import annotations

import os
import select

import pytest

from statechat.tui.terminal import typeahead

termios = pytest.importorskip("termios")


def readable(fd: int, timeout: float = 0.2) -> bytes:
    """What `fd` has to read now (b"" if nothing comes within `timeout`)."""
    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1024) if ready else b""


@pytest.fixture
def pty():
    master, slave = os.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def test_cooked_mode_eats_ctrl_q(pty):
    """(Why typeahead exists: a new terminal's default settings drop it.)"""
    master, slave = pty
    os.write(master, b"\x11x\n")
    assert readable(slave) == b"x\n"


def test_ctrl_q_typed_early_waits_for_the_app(pty):
    master, slave = pty
    before = termios.tcgetattr(slave)
    with typeahead(slave):
        os.write(master, b"\x11")
        assert readable(slave) == b"\x11"  # (at once: no Enter needed)
        assert readable(master) == b""  # (not echoed over the shell)
    assert termios.tcgetattr(slave) == before


def test_settings_come_back_after_the_app_changed_them(pty):
    """Textual restores what it found (typeahead's settings); the terminal gets its own."""
    _, slave = pty
    before = termios.tcgetattr(slave)
    with pytest.raises(KeyboardInterrupt), typeahead(slave):
        attrs = termios.tcgetattr(slave)
        attrs[3] &= ~termios.ISIG
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        raise KeyboardInterrupt  # (Ctrl+C while torch imports)
    assert termios.tcgetattr(slave) == before


def test_no_terminal_is_left_alone(tmp_path):
    with open(tmp_path / "f", "w") as f, typeahead(f.fileno()):
        pass


def test_run_reads_its_config_and_runs_the_app_inside_typeahead(monkeypatch, tmp_path):
    """`statechat run` enters typeahead before its slow start (torch's import in engine_config)
    and leaves it only after the app ends."""
    import contextlib

    from typer.testing import CliRunner

    import statechat.tui.terminal
    from statechat import cli, cli_setup

    seen = []

    @contextlib.contextmanager
    def spy():
        seen.append("enter")
        try:
            yield
        finally:
            seen.append("exit")

    def config(*args, **kwargs):
        seen.append("config")
        raise cli.StatechatError("stop here")

    monkeypatch.setattr(statechat.tui.terminal, "typeahead", spy)
    monkeypatch.setattr(cli_setup, "engine_config", config)
    result = CliRunner().invoke(cli.app, ["run", "--cache-dir", str(tmp_path)])
    assert result.exit_code != 0 and seen == ["enter", "config", "exit"]


def test_a_kill_while_run_starts_gives_the_terminal_back(pty):
    """SIGTERM's default action ended the process inside typeahead, leaving the terminal with
    no echo, no line editing and no flow control; it now leaves as an exit with status 143."""
    import signal

    _, slave = pty
    before, handler = termios.tcgetattr(slave), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as ended, typeahead(slave):
            os.kill(os.getpid(), signal.SIGTERM)  # (its handler runs before the next line)
        assert ended.value.code == 143 and termios.tcgetattr(slave) == before
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, handler)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_kill_after_the_app_ended_gives_the_terminal_back(pty, loaded, tmp_path, name):
    """The app takes SIGTERM and SIGHUP while it runs, and giving them back as it closed left
    them at their default action, not typeahead's: a kill between the app's close and the end
    of typeahead ended the process with the terminal still without echo or line editing."""
    import asyncio
    import signal

    from tests.tui.test_app import make_app, wait_ready

    if not hasattr(signal, name):
        pytest.skip(f"no {name} on this platform")
    signum = getattr(signal, name)

    async def run_app() -> None:
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot, app)
            assert signum in app.quit_signals

    _, slave = pty
    before, handler = termios.tcgetattr(slave), signal.signal(signum, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as ended, typeahead(slave):
            asyncio.run(run_app())
            # (checked first: the default action would end pytest itself)
            assert signal.getsignal(signum) is not signal.SIG_DFL
            os.kill(os.getpid(), signum)
        assert ended.value.code == 128 + signum and termios.tcgetattr(slave) == before
        assert signal.getsignal(signum) is signal.SIG_DFL
    finally:
        signal.signal(signum, handler)


@pytest.mark.parametrize("moment", ["right after the change", "as the restore begins"])
def test_a_kill_at_either_end_of_typeahead_gives_the_terminal_back(pty, monkeypatch, moment):
    """typeahead() took the signals only after it changed the terminal and gave them back
    before it restored it, so SIGTERM's default action at either moment left the terminal
    changed; and a signal as the restore began raised before it ran. Here SIGTERM comes
    right after the terminal is changed, or as its restore begins."""
    import signal

    _, slave = pty
    before, handler = termios.tcgetattr(slave), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    real, seen = termios.tcsetattr, []

    def tcsetattr(fd, when, attrs):
        is_restore = attrs == before
        if not is_restore:
            real(fd, when, attrs)
        if is_restore == (moment == "as the restore begins") and not seen:
            seen.append(signal.getsignal(signal.SIGTERM))
            assert seen[0] is not signal.SIG_DFL  # (checked first: it would end pytest)
            os.kill(os.getpid(), signal.SIGTERM)  # (its handler runs before the next line)
        if is_restore:
            real(fd, when, attrs)

    monkeypatch.setattr(termios, "tcsetattr", tcsetattr)
    try:
        with pytest.raises(SystemExit) as ended, typeahead(slave):
            pass
        assert seen and ended.value.code == 143 and termios.tcgetattr(slave) == before
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, handler)
