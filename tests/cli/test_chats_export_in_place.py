"""`statechat chats export -o FILE --force` where FILE is a link (or a device): a write that
fails (a full disk) says so in one line and leaves the link as it was. It removed FILE, as it
removes a half-written file of its own: the user's link, or, run as root, the device node
itself (`-o /dev/full --force` deleted /dev/full)."""

from __future__ import annotations

import os

import pytest

from statechat import cli_chats
from tests.cli.test_chats import chats, seed


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_failed_export_through_a_link_keeps_the_link(tmp_path):
    seed(tmp_path / "cache")
    link = tmp_path / "out.md"
    link.symlink_to("/dev/full")  # (every write there fails: No space left on device)
    result = chats(tmp_path, "export", "Plans", "-o", str(link), "--force")
    assert result.exit_code == 2 and "No space left" in result.stderr, result.stderr
    assert "\n" not in result.stderr.strip()
    assert link.is_symlink() and os.readlink(link) == "/dev/full"


def test_a_failed_new_export_leaves_no_half_written_file(tmp_path, monkeypatch):
    seed(tmp_path / "cache")
    target = tmp_path / "new.md"

    def full_disk(path, mode, **kwargs):
        f = open(path, mode, **kwargs)  # noqa: SIM115 - (made, then every write fails)
        f.write = lambda text: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return f

    monkeypatch.setattr(cli_chats, "open", full_disk, raising=False)
    result = chats(tmp_path, "export", "Plans", "-o", str(target))
    assert result.exit_code == 2 and "No space left" in result.stderr, result.stderr
    assert not target.exists()
