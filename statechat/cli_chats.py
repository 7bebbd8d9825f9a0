"""`statechat chats ...`: the terminal app's chats from the command line, without the app or a
model. `ls` lists them, `show` prints the branch the app shows (each chat's current branch),
`export` writes it as the app's Export chat does (chat/transcript.py), `rm` deletes a chat with
the store's own delete (another statechat on the same cache dir sees it gone). `ls`, `show` and
`export` only read: the chats' file is opened read-only, so they work on read-only media, and
no command creates a cache dir or an index.db.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from statechat.chat.records import Conversation
from statechat.chat.transcript import branch_markdown, one_line, split_thinking, turns_of
from statechat.chat.tree import ChatStore, open_chats
from statechat.cli_cache import confirmed
from statechat.cli_cache_store import cache_root
from statechat.cli_options import CacheDirOpt, FlagsGroup, JsonOpt
from statechat.errors import StatechatError

chats_app = typer.Typer(cls=FlagsGroup, help="List, show, export and delete the app's chats.",
                        no_args_is_help=True)
NUM_CANDIDATES = 5  # the most chats an unknown name's error suggests
ROLES = {"user": "User", "assistant": "Assistant", "system": "System"}

ChatArg = Annotated[str, typer.Argument(
    metavar="CHAT", help="The chat: its id (`statechat chats ls` lists them), or its title "
    "where no other chat has it.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")]


def has_terminal() -> bool:
    """Whether a person can answer a question on standard input."""
    return sys.stdin is not None and sys.stdin.isatty()


@contextlib.contextmanager
def _reading(cache_dir: Path | None) -> Iterator[tuple[Path, ChatStore | None]]:
    """The cache dir and its chats, opened to read alone; None where it holds none (no folder,
    no index.db, or one without the chats' tables): nothing is created."""
    root = cache_root(cache_dir)
    if not (root / "index.db").exists():
        yield root, None
        return
    store = open_chats(root, read_only=True)
    try:
        yield root, store if store.has_chats else None
    finally:
        store.close()


def _title(conv: Conversation) -> str:
    """A chat's title as the app lists it: on one line, safe for the terminal."""
    from statechat.tui.format import clean  # (plain text rules: no Textual imported)

    return one_line(clean(conv.title))


def _named(conv: Conversation) -> str:
    return f"{conv.id} ({_title(conv)})"


def find_chat(store: ChatStore | None, root: Path, name: str) -> Conversation:
    """The chat `name` names: its id, else its title where no other chat has it; a one-line
    StatechatError naming the candidates otherwise."""
    if store is None:
        raise StatechatError(f"no chats at {root} yet (the app keeps them there once it has one)")
    convs = store.conversations()
    by_id = [c for c in convs if c.id == name]
    if by_id:
        return by_id[0]
    titled = [c for c in convs if one_line(c.title) == one_line(name)]
    if len(titled) == 1:
        return titled[0]
    if titled:
        raise StatechatError(f"'{one_line(name)}' names {len(titled)} chats: "
                             f"{', '.join(_named(c) for c in titled)}; pass its id")
    words = one_line(name).casefold()
    near = [c for c in convs if c.id.startswith(name) or words in c.title.casefold()]
    hint = (f"did you mean {', '.join(_named(c) for c in near[:NUM_CANDIDATES])}?" if near
            else f"`statechat chats ls --cache-dir {root}` lists them")
    raise StatechatError(f"no chat '{one_line(name)}' at {root}; {hint}")


@chats_app.command("ls", short_help="List the chats, newest first (--json: a JSON array).")
def chats_ls(cache_dir: CacheDirOpt = None, as_json: JsonOpt = False) -> None:
    """List the chats, most recently updated first: id, last update, messages, branches,
    title."""
    from statechat.cli_cache import _when

    with _reading(cache_dir) as (root, store):
        convs = store.conversations() if store else []
        shape = store.shape() if store else {}
    rows = [(c, *shape.get(c.id, (0, 0))) for c in convs]
    if as_json:
        typer.echo(json.dumps([{"id": c.id, "title": c.title, "num_messages": num,
                                "num_branches": leaves, "updated": c.updated}
                               for c, num, leaves in rows], ensure_ascii=False))
        return
    if not rows:
        typer.echo(f"no chats at {root} yet")
    for c, num, leaves in rows:
        counts = f"{num:>5,} message{'' if num == 1 else 's'} {leaves:>4,} " \
                 f"branch{'' if leaves == 1 else 'es'}"
        typer.echo(f"{c.id}  {_when(c.updated)}  {counts}  {_title(c)}")


def _message_json(role: str, content: str, thinking: bool) -> dict:
    """A message as `show --json` gives it: a reply's reasoning apart from its answer."""
    reasoning, answer = (split_thinking(content, opened=thinking) if role == "assistant"
                         else ("", content))
    return {"role": role, "content": answer, **({"reasoning": reasoning} if reasoning else {})}


ShowJsonOpt = Annotated[bool, typer.Option("--json", help="Print the messages as JSON: "
                                           '[{"role", "content", "reasoning"}].')]


@chats_app.command("show", short_help="Print the branch of a chat that the app shows.")
def chats_show(chat: ChatArg, cache_dir: CacheDirOpt = None, as_json: ShowJsonOpt = False) -> None:
    """Print the chat's branch that the app shows (its current one), message by message;
    --json: its messages, [{"role", "content", "reasoning" (where a reply has one)}]."""
    from statechat.tui.format import clean

    with _reading(cache_dir) as (root, store):
        conv = find_chat(store, root, chat)
        turns = turns_of(store.branch(conv.id))
    if as_json:
        typer.echo(json.dumps([_message_json(*turn) for turn in turns], ensure_ascii=False))
        return
    typer.secho(f"# {_title(conv)}", bold=True)
    if not turns:
        typer.echo("\n(no messages yet)")
    for role, content, thinking in turns:
        message = _message_json(role, content, thinking)
        typer.secho(f"\n{ROLES.get(role, one_line(clean(role)))}:", bold=True)
        if "reasoning" in message:
            typer.secho(f"thinking: {clean(message['reasoning'])}", dim=True, italic=True)
        typer.echo(clean(message["content"]).strip("\n"))


ExportOutputOpt = Annotated[Path | None, typer.Option(
    "--output", "-o", metavar="FILE", help="The Markdown file to write (a new one, unless "
    "--force); default (or '-'): stdout.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite FILE if it exists.")]


@chats_app.command("export",
                   short_help="Write the branch of a chat that the app shows as Markdown.")
def chats_export(chat: ChatArg, output: ExportOutputOpt = None, force: ForceOpt = False,
                 cache_dir: CacheDirOpt = None) -> None:
    """Write the chat's shown branch as Markdown, as the app's Export chat does: a heading per
    message, a reply's reasoning in a collapsed <details> block."""
    with _reading(cache_dir) as (root, store):
        conv = find_chat(store, root, chat)
        markdown = branch_markdown(conv.title, turns_of(store.branch(conv.id)))
    if output is None or str(output) == "-":
        typer.echo(markdown, nl=False)
        return
    _write(output, markdown, force)
    typer.echo(f"exported chat {_named(conv)} to {output}")


def _write(path: Path, text: str, force: bool) -> None:
    """`text` into the file `path`, a new one unless `force` (the exclusive open holds against
    another process making it meanwhile); a file left half-written (a full disk) is removed,
    but not a link or a device written through (`-o /dev/full --force` deleted the device);
    what stops it is one line."""
    try:
        f = open(path, "w" if force else "x", encoding="utf-8")  # noqa: SIM115 - (closed below)
    except FileExistsError:
        raise StatechatError(f"{path} exists; pass --force to overwrite it, or pick another "
                             "file") from None
    except OSError as e:
        raise StatechatError(f"cannot write {path} ({e.strerror or e})") from None
    try:
        with f:
            f.write(text)
    except OSError as e:
        if path.is_file() and not path.is_symlink():  # (a plain file: not a link or a device)
            path.unlink(missing_ok=True)
        raise StatechatError(f"cannot write {path} ({e.strerror or e}); nothing was "
                             "kept") from None


@chats_app.command("rm", short_help="Delete a chat and all its messages.")
def chats_rm(chat: ChatArg, yes: YesOpt = False, cache_dir: CacheDirOpt = None) -> None:
    """Delete a chat and all its messages (every branch). Asks first, unless --yes; with no
    terminal to ask on, refuses; any answer but yes deletes nothing and exits 1."""
    with _reading(cache_dir) as (root, store):
        conv = find_chat(store, root, chat)
        num = store.shape().get(conv.id, (0, 0))[0]
    what = f"chat {_named(conv)}"
    if not yes:
        if not has_terminal():
            raise StatechatError(f"not deleting {what}: no terminal to ask on; pass --yes")
        if not confirmed(f"Delete {what} and its {num:,} message{'' if num == 1 else 's'}?"):
            typer.echo("Aborted: nothing deleted.", err=True)
            raise typer.Exit(1)
    store = open_chats(root)
    try:
        store.delete_conversation(conv.id)
    finally:
        store.close()
    typer.echo(f"deleted {what}")
