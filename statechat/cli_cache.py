"""`statechat cache ...`: inspect and trim the persistent prefix cache. `path`, `stats` and `ls`
only read (the index opened read-only: they work on a read-only cache); `verify` removes what
fails its checks, `gc` and `clear` delete. None of them creates a cache dir or an index.db."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from statechat.cli_cache_store import (
    cache_root,
    check_writable,
    has_cache,
    opened_store,
    os_error_line,
    writable,
    writing,
)
from statechat.cli_options import CacheDirOpt, FlagsGroup, JsonOpt, parse_size

cache_app = typer.Typer(cls=FlagsGroup, help="Inspect and trim the persistent prefix cache.",
                        no_args_is_help=True)
# `cache verify`'s exit status, as fsck's: bits that say what it did (0: all was fine)
VERIFY_REPAIRED = 1  # it removed damaged entries or orphan blobs
VERIFY_LEFT = 4  # it found problems it left as they are (unreadable blobs, a read-only cache)


def confirmed(question: str) -> bool:
    """The answer to a yes/no question, asked on stderr as `rm -i` asks (stdout sent to a file
    holds only what was done): y or yes is yes; any other answer, or none (end of input,
    Ctrl-C), is no."""
    typer.echo(f"{question} [y/N]: ", nl=False, err=True)
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except KeyboardInterrupt:
        answer = ""
    if not answer.endswith("\n") or not sys.stdin.isatty():  # (ends the question's line)
        typer.echo(err=True)
    return answer.strip().lower() in ("y", "yes")


def _size(n: int | None) -> str:
    from statechat.cache.sqlite_files import size_text

    return size_text(n)


def _count(n) -> str:
    return f"{n:,}" if isinstance(n, int) else "-"


def _things(n, noun: str) -> str:
    """`n` `noun`s, as "1 checkpoint" or "2,048 blocks"."""
    return f"{_count(n)} {noun}{'' if n == 1 else 's'}"


def _when(ts) -> str:
    import datetime

    if not isinstance(ts, int | float):
        return str(ts or "-")
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


@cache_app.command("path")
def cache_path(cache_dir: CacheDirOpt = None) -> None:
    """Print the cache directory."""
    # (a file in its place, or above it: one line on stderr and exit status 2, as the others)
    typer.echo(str(cache_root(cache_dir)))


def _no_stats(root: Path) -> dict:
    """`cache stats --json` of a cache dir not made yet: StateStore.stats's fields, empty, and
    the budget an engine would start it with (the default rule's, of the nearest folder's
    disk), as for an empty cache dir (None in a build without the persistent cache)."""
    try:
        from statechat.cache.store.budget import default_budget
    except ImportError:
        budget = None
    else:
        budget = default_budget(root)
    return {"path": str(root), "num_checkpoints": 0, "num_blocks": 0,
            "num_segments": 0, "bytes_total": 0, "bytes_index": 0, "bytes_budget": budget,
            "bytes_budget_default": budget, "budget_recorded": None, "host_bytes_used": 0,
            "host_bytes_capacity": 0, "host_bytes_not_kept": 0, "models": []}


@cache_app.command(
    "stats", short_help="Checkpoints, blocks, bytes used against the budget, and their models.")
def cache_stats(cache_dir: CacheDirOpt = None, as_json: JsonOpt = False) -> None:
    """Checkpoints, blocks, bytes used against the budget, and the models they belong to. The
    budget is the one `cache gc` keeps to: set with --disk-cache-bytes by the last engine that
    wrote (which, and when, are said), else the default (10% of the free space and of the
    cache's own). A folder with no cache (no index.db, no blobs/) is one line saying so (with
    --json: the figures, empty)."""
    root = cache_root(cache_dir)
    if not as_json and not has_cache(root):
        typer.echo(f"no cache at {root}")
        return
    with opened_store(root) as store:
        stats = store.stats() if store else _no_stats(root)
    if as_json:
        typer.echo(json.dumps(stats, indent=2, default=str))
        return
    typer.echo(f"checkpoints  {stats.get('num_checkpoints', 0):,}")
    typer.echo(f"KV blocks    {stats.get('num_blocks', 0):,}")
    typer.echo(f"segments     {stats.get('num_segments', 0):,}")
    typer.echo(f"bytes        {_size(stats.get('bytes_total'))} "
               f"of {_size(stats.get('bytes_budget'))}")
    typer.echo(f"budget       {_budget_line(stats)}")
    typer.echo(f"index        {_size(stats.get('bytes_index'))} (index.db, the chats in it too, "
               "and its write-ahead log: beside the budget, which counts the blobs)")
    for m in stats.get("models") or []:  # (its size in the total's unit, not the view's MB)
        typer.echo(f"model        {m.get('name')} (id {m.get('id')}, {m.get('dtype')}, "
                   f"{m.get('block_size')}-token blocks): "
                   f"{_things(m.get('checkpoints', 0), 'checkpoint')}, "
                   f"{_things(m.get('blocks', 0), 'block')}, {_size(m.get('bytes'))}")


def _budget_line(stats: dict) -> str:
    """Where `stats`' budget comes from: set with --disk-cache-bytes by the last engine that
    wrote (which, when), else the default rule's; and the default, where it is not used."""
    default, rec = stats.get("bytes_budget_default"), stats.get("budget_recorded")
    rule = "10% of the free space and of the cache's own"
    if rec and rec.get("explicit"):
        return (f"{_size(rec['bytes'])}, set with --disk-cache-bytes by `{rec['program']}` "
                f"(pid {rec['pid']}, last write {_when(rec['set_at'])}); the default would be "
                f"{_size(default)} ({rule})")
    line = f"{_size(default)}, the default ({rule}, taken now)"
    if rec:
        line += (f"; `{rec['program']}` (pid {rec['pid']}) last wrote under "
                 f"{_size(rec['bytes'])}, the default as it started, {_when(rec['set_at'])}")
    return line


@cache_app.command("ls")
def cache_ls(cache_dir: CacheDirOpt = None, as_json: JsonOpt = False,
             limit: Annotated[int, typer.Option(help="Show at most this many checkpoints.", min=1,
                                                max=1_000_000)] = 50) -> None:
    """List checkpoints, most recently used first (stderr says how many --limit left out)."""
    with opened_store(cache_root(cache_dir)) as store:
        rows = store.ls(limit=limit) if store else []
        total = store.stats()["num_checkpoints"] if store and len(rows) == limit else len(rows)
    if total > len(rows):  # (on stderr: stdout stays the table, or the JSON)
        typer.echo(f"statechat: showing the {len(rows):,} most recently used of {total:,} "
                   "checkpoints; --limit N shows more", err=True)
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    typer.echo(f"{'tokens':>8}  {'size':>10}  {'hits':>5}  {'created':16}  {'last used':16}  model")
    for r in rows:  # (a NULL that a hand edit left, as "-")
        typer.echo(f"{_count(r.get('num_tokens')):>8}  {_size(r.get('bytes')):>10}  "
                   f"{_count(r.get('hits')):>5}  {_when(r.get('created')):16}  "
                   f"{_when(r.get('last_used')):16}  {r.get('model') or '-'}")
    if not rows:
        typer.echo("(no checkpoints yet)")


@cache_app.command(
    "verify", short_help="Check every blob against its checksum; remove what fails, and orphans.")
def cache_verify(cache_dir: CacheDirOpt = None) -> None:
    """Check every blob against its checksum; remove entries that fail, and blob files no index
    row points at (a blob that cannot be read, for its permissions say, is reported and kept;
    on a read-only cache everything is reported and kept).

    Exit status, as fsck's: 0 all was fine; 1 it removed damaged entries or orphan blobs (the
    cache is sound now); 4 it found problems it left (unreadable blobs, a models row edited
    so that it no longer matches its blobs, a read-only cache); 5
    both; 2 the index could not be opened or is damaged."""
    root = cache_root(cache_dir)
    remove = root.is_dir() and writable(root)
    with opened_store(root, write=remove) as store:
        report = store.verify(remove=remove) if store else {}
    failed, unreadable = report.get("removed") or [], report.get("unreadable") or []
    orphans = report.get("orphans") or []
    done = "removed" if remove or not root.exists() else "failed"  # (failed: damaged, kept)
    kept = " (kept: the cache is read-only)" if failed and not remove else ""
    typer.echo(f"checked {report.get('checked', 0):,}; ok {report.get('ok', 0):,}; "
               f"{done} {len(failed):,}{kept}"
               + (f"; unreadable, kept {len(unreadable):,}" if unreadable else ""))
    for item in failed:
        typer.echo(f"  {done} {item}")
    for item in unreadable:
        typer.echo(f"  unreadable (kept) {item}")
    if orphans:
        one = len(orphans) == 1
        blobs, them = ("orphan blob", "it") if one else ("orphan blobs", "them")
        typer.echo(f"removed {len(orphans):,} {blobs} ({_size(report.get('orphans_freed'))}; no "
                   f"index row points at {them})" if remove else
                   f"found {len(orphans):,} {blobs} (no index row points at {them}; kept: the "
                   "cache is read-only)")
        for item in orphans:
            typer.echo(f"  {'removed' if remove else 'found'} orphan {item}")
    dangling = report.get("dangling") or []
    _say_dangling(dangling, remove)
    mismatched = report.get("mismatched_models") or []
    for m in mismatched:
        typer.echo(f"model row {m['id']} ({m['name']}) does not match its {m['blobs']:,} blobs, "
                   "which are sound (its fingerprint or shapes edited by hand?): kept them, as "
                   "an engine of that model still resumes from them; put the row back as it "
                   "was, or `statechat cache clear` deletes them")
    found = bool(failed or orphans or dangling)
    status = ((VERIFY_REPAIRED if remove and found else 0)
              | (VERIFY_LEFT if unreadable or mismatched or (found and not remove) else 0))
    if status:
        raise typer.Exit(status)


def _say_dangling(dangling: list[str], remove: bool) -> None:
    """`verify`'s lines for the checkpoints left without a block of their chain."""
    if not dangling:
        return
    what, them = ("checkpoint", "it") if len(dangling) == 1 else ("checkpoints", "them")
    done = "removed" if remove else "found"
    typer.echo(f"{done} {len(dangling):,} {what} whose blocks are gone (no request could resume "
               f"from {them}{'' if remove else '; kept: the cache is read-only'})")
    for item in dangling:
        typer.echo(f"  {done} {item}")


@cache_app.command(
    "gc", short_help="Evict least recently used entries down to the byte budget, and orphans.")
def cache_gc(cache_dir: CacheDirOpt = None,
             max_size: Annotated[str | None, typer.Option(
                 "--max-bytes", help="Evict least recently used entries until the cache is at "
                                     "most this size, in bytes or as 500M, 20G (default: the "
                                     "budget `cache stats` shows: the last engine's where set "
                                     "with --disk-cache-bytes, else 10% of the free space and "
                                     "of the cache's own, so on a full disk 10% of the cache).")
             ] = None) -> None:
    """Evict least recently used entries down to the byte budget, and delete blob files that no
    index row points at.

    The budget is the one an engine evicts down to: where the last engine that wrote to the
    cache ran with --disk-cache-bytes, that size (on a full disk too: --max-bytes trims
    further); else the default, 10% of the free space and of the cache's own blobs, taken now.
    On a full disk that is 10% of the cache: it gives back 90% of itself, a tenth of the space
    other files took, as an engine started there would after its first save."""
    max_bytes = parse_size(max_size, "--max-bytes")
    root = cache_root(cache_dir)
    check_writable(root)
    freed = writing(root, "verify", lambda store: store.gc(max_bytes),
                     lambda: _evict_blobs_first(root, max_bytes))
    typer.echo(f"freed {_size(freed)}")


def _evict_blobs_first(root: Path, max_bytes: int | None) -> tuple[list[str], int]:
    """(gc on a full disk) The blob files of the rows gc evicts first, deleted, the index read
    alone: their names and bytes."""
    from statechat.cache.store.freeing import delete_evicted_blobs

    with opened_store(root, deletes=True) as store:
        return delete_evicted_blobs(store, store.budgets()["bytes_budget"] if max_bytes is None
                                    else max_bytes)


@cache_app.command(
    "clear", short_help="Delete every cached checkpoint and block (conversations are kept).")
def cache_clear(cache_dir: CacheDirOpt = None,
                yes: Annotated[bool, typer.Option("--yes", "-y",
                                                  help="Do not ask.")] = False) -> None:
    """Delete every cached checkpoint and block (conversations are kept). Asks first, unless
    --yes, reading the answer from standard input as `rm -i` does (a pipe's too); any answer
    but yes, or none, deletes nothing and exits 1."""
    # (the bytes said are those of the blob files deleted; a folder with no cache is said so)
    root = cache_root(cache_dir)
    if not has_cache(root):
        typer.echo(f"no cache at {root}; nothing to delete")
        return
    check_writable(root)
    if not yes and not confirmed(f"Delete every cache entry in {root}?"):
        typer.echo("Aborted: nothing deleted.", err=True)
        raise typer.Exit(1)
    freed = writing(root, "clear --yes", lambda store: store.clear(),
                     lambda: _clear_blobs_first(root))
    typer.echo(f"freed {_size(freed)}")


def _clear_blobs_first(root: Path) -> tuple[list[str], int]:
    """(clear on a full disk) Every blob file deleted, the index untouched: clear's rows go
    once there is room."""
    from statechat.cache.store.freeing import delete_blob_files

    try:
        return [], delete_blob_files(root / "blobs")
    except OSError as e:
        raise os_error_line(root, e, "delete") from None


