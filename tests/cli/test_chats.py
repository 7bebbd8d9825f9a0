"""`statechat chats`: the app's chats listed, shown and exported (the branch the app shows, as
the app's own Export chat writes it) and deleted from the command line, without the app and
without a model; a chat named by id or by a unique title, other names one line that names the
candidates; a missing store said plainly and left uncreated; a read-only store readable."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from statechat import cli, cli_chats
from statechat.chat.transcript import branch_markdown
from statechat.chat.tree import open_chats
from tests.cli.test_commands import read_only_view  # noqa: F401 - (a fixture)

runner = CliRunner()
REASONED = "<think>\nmulling it over\n</think>\n\nan **answer**"


def seed(cache_dir) -> dict[str, str]:
    """Three chats: "Plans" (a question, two replies: the second shown), "Empty" (no message)
    and "Twin" twice. Their ids by name ("plans", "empty", "twin1", "twin2", "first")."""
    chats = open_chats(cache_dir)
    plans = chats.create("Plans")
    asked = chats.add(plans.id, None, "user", "what now?")
    first = chats.add(plans.id, asked.id, "assistant", "first reply")
    chats.add(plans.id, asked.id, "assistant", REASONED, stats={"finish_reason": "stop"})
    twin1, twin2 = chats.create("Twin"), chats.create("Twin")
    empty = chats.create("Empty")
    chats.close()
    return {"plans": plans.id, "empty": empty.id, "twin1": twin1.id, "twin2": twin2.id,
            "first": first.id}


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str


def chats(tmp_path, *argv, input: str | None = None, cache_dir=None) -> Ran:
    """`statechat chats ARGV --cache-dir TMP/cache` as `main` runs it (errors in one line), in
    CliRunner's isolation (`input` its standard input, no terminal)."""
    argv_before = sys.argv
    sys.argv = ["statechat", "chats", *argv, "--cache-dir", str(cache_dir or tmp_path / "cache")]
    try:
        with runner.isolation(input=input) as (out, err, _):
            try:
                cli.main()
                code = 0
            except SystemExit as e:
                code = e.code or 0
            return Ran(code, out.getvalue().decode(), err.getvalue().decode())
    finally:
        sys.argv = argv_before


def test_ls_lists_the_chats_newest_first(tmp_path):
    ids = seed(tmp_path / "cache")
    result = chats(tmp_path, "ls")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [ids["empty"], ids["twin2"], ids["twin1"],
                                                   ids["plans"]]
    assert "3 messages" in lines[-1] and "2 branches" in lines[-1] and "Plans" in lines[-1]
    listed = json.loads(chats(tmp_path, "ls", "--json").stdout)
    assert [c["id"] for c in listed] == [ids["empty"], ids["twin2"], ids["twin1"], ids["plans"]]
    assert listed[-1] | {"updated": 0} == {"id": ids["plans"], "title": "Plans",
                                          "num_messages": 3, "num_branches": 2, "updated": 0}


def test_show_prints_the_branch_the_app_shows(tmp_path):
    ids = seed(tmp_path / "cache")
    text = chats(tmp_path, "show", "Plans")
    assert text.exit_code == 0, text.output
    assert "what now?" in text.stdout and "an **answer**" in text.stdout
    assert "mulling it over" in text.stdout and "first reply" not in text.stdout
    shown = json.loads(chats(tmp_path, "show", ids["plans"], "--json").stdout)
    assert shown == [{"role": "user", "content": "what now?"},
                     {"role": "assistant", "content": "an **answer**",
                      "reasoning": "mulling it over"}]
    store = open_chats(tmp_path / "cache")  # (the app switched back to the first reply)
    store.select(ids["first"])
    store.close()
    shown = json.loads(chats(tmp_path, "show", "Plans", "--json").stdout)
    assert shown[-1] == {"role": "assistant", "content": "first reply"}


@pytest.mark.parametrize("name, says", [
    ("Twin", "'Twin' names 2 chats: {twin2} (Twin), {twin1} (Twin)"),
    ("nothing", "no chat 'nothing'"),
    ("Pla", "did you mean {plans} (Plans)?"),
])
def test_an_ambiguous_or_unknown_chat_is_one_line_naming_the_candidates(tmp_path, name, says):
    ids = seed(tmp_path / "cache")
    for argv in (["show"], ["export", "--force"], ["rm", "--yes"]):
        result = chats(tmp_path, argv[0], name, *argv[1:])
        assert result.exit_code == 2, result.stderr
        err = result.stderr.strip()
        assert err.startswith("statechat: ") and "\n" not in err, err
        assert says.format(**ids) in err, err
    assert len(json.loads(chats(tmp_path, "ls", "--json").stdout)) == 4  # nothing deleted


def test_export_writes_the_app_s_markdown_and_never_overwrites(tmp_path):
    seed(tmp_path / "cache")
    expected = branch_markdown("Plans", [("user", "what now?", False),
                                         ("assistant", REASONED, False)])
    out = chats(tmp_path, "export", "Plans")
    assert (out.exit_code, out.stdout) == (0, expected)
    assert chats(tmp_path, "export", "Plans", "-o", "-").stdout == expected
    target = tmp_path / "plans.md"
    assert chats(tmp_path, "export", "Plans", "-o", str(target)).exit_code == 0
    assert target.read_text(encoding="utf-8") == expected
    target.write_text("mine")
    again = chats(tmp_path, "export", "Plans", "-o", str(target))
    assert again.exit_code == 2 and "--force" in again.stderr and "\n" not in again.stderr.strip()
    assert target.read_text() == "mine"
    assert chats(tmp_path, "export", "Plans", "-o", str(target), "--force").exit_code == 0
    assert target.read_text(encoding="utf-8") == expected


def test_rm_asks_first_and_refuses_without_a_terminal(tmp_path, monkeypatch):
    ids = seed(tmp_path / "cache")
    refused = chats(tmp_path, "rm", "Plans")  # (no terminal: CliRunner's input is none)
    assert refused.exit_code != 0 and "--yes" in refused.stderr
    assert "\n" not in refused.stderr.strip()
    monkeypatch.setattr(cli_chats, "has_terminal", lambda: True)
    kept = chats(tmp_path, "rm", "Plans", input="n\n")
    assert kept.exit_code == 1 and "nothing deleted" in kept.stderr
    assert chats(tmp_path, "show", ids["plans"]).exit_code == 0
    gone = chats(tmp_path, "rm", "Plans", input="y\n")
    assert gone.exit_code == 0 and "deleted" in gone.stdout
    assert chats(tmp_path, "rm", ids["empty"], "--yes").exit_code == 0
    listed = [c["id"] for c in json.loads(chats(tmp_path, "ls", "--json").stdout)]
    assert listed == [ids["twin2"], ids["twin1"]]
    store = open_chats(tmp_path / "cache")  # (the store's own delete: no message left behind)
    assert store.db.execute("SELECT count(*) FROM chat_messages").fetchone()[0] == 0
    store.close()


def test_a_missing_store_is_said_plainly_and_not_created(tmp_path):
    listed = chats(tmp_path, "ls")
    assert listed.exit_code == 0 and "no chats" in listed.stdout + listed.stderr
    assert chats(tmp_path, "ls", "--json").stdout == "[]\n"
    shown = chats(tmp_path, "show", "x")
    assert shown.exit_code == 2 and "no chats" in shown.stderr
    assert not (tmp_path / "cache").exists()


def test_a_read_only_store_can_be_read(tmp_path, read_only_view):  # noqa: F811
    """ls, show and export read chats on read-only media; rm refuses there in one line."""
    ids = seed(tmp_path / "cache")
    view = read_only_view(tmp_path / "cache")
    listed = chats(tmp_path, "ls", "--json", cache_dir=view)
    assert listed.exit_code == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 4
    assert "an **answer**" in chats(tmp_path, "show", ids["plans"], cache_dir=view).stdout
    assert "# Plans" in chats(tmp_path, "export", "Plans", cache_dir=view).stdout
    rm = chats(tmp_path, "rm", "Plans", "--yes", cache_dir=view)
    assert rm.exit_code == 2 and "\n" not in rm.stderr.strip(), rm.stderr
