"""`statechat cache ...`: inspect and trim the persistent prefix cache (read-only but for `gc`
and `clear`; a cache dir that does not exist yet is not made)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from statechat.cli_options import CacheDirOpt, JsonOpt
from statechat.errors import StatechatError

cache_app = typer.Typer(help="Inspect and trim the persistent prefix cache.", no_args_is_help=True)


def _store(cache_dir: Path | None):
    """The store of the cache dir, or None where there is no cache dir yet: the cache commands
    only read or delete, so they do not create one (a note on stderr says so)."""
    from statechat.paths import cache_dir as resolve_cache_dir

    root = resolve_cache_dir(cache_dir)
    if not root.exists():
        typer.echo(f"no cache at {root} yet", err=True)
        return None
    try:
        from statechat.cache.store import open_store
    except ImportError:
        raise StatechatError("this build has no persistent cache (statechat.cache.store is missing)") from None
    return open_store(root)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _when(ts) -> str:
    import datetime

    if not isinstance(ts, int | float):
        return str(ts or "-")
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


@cache_app.command("path")
def cache_path(cache_dir: CacheDirOpt = None) -> None:
    """Print the cache directory."""
    from statechat.paths import cache_dir as resolve_cache_dir

    typer.echo(str(resolve_cache_dir(cache_dir)))


def _no_stats(cache_dir: Path | None) -> dict:
    """`cache stats` of a cache dir not made yet: StateStore.stats's fields, empty."""
    from statechat.paths import cache_dir as resolve_cache_dir

    return {"path": str(resolve_cache_dir(cache_dir)), "num_checkpoints": 0, "num_blocks": 0,
            "num_segments": 0, "bytes_total": 0, "bytes_budget": None, "host_bytes_used": 0,
            "host_bytes_capacity": 0, "host_bytes_not_kept": 0, "models": []}


@cache_app.command("stats")
def cache_stats(cache_dir: CacheDirOpt = None, as_json: JsonOpt = False) -> None:
    """Checkpoints, blocks, bytes used against the budget, and the models they belong to."""
    store = _store(cache_dir)
    stats = store.stats() if store else _no_stats(cache_dir)
    if as_json:
        typer.echo(json.dumps(stats, indent=2, default=str))
        return
    typer.echo(f"checkpoints  {stats.get('num_checkpoints', 0):,}")
    typer.echo(f"KV blocks    {stats.get('num_blocks', 0):,}")
    typer.echo(f"segments     {stats.get('num_segments', 0):,}")
    typer.echo(f"bytes        {_size(stats.get('bytes_total'))} of {_size(stats.get('bytes_budget'))}")
    for m in stats.get("models") or []:
        typer.echo("model        " + ", ".join(f"{k}={v}" for k, v in m.items()))


@cache_app.command("ls")
def cache_ls(cache_dir: CacheDirOpt = None, as_json: JsonOpt = False,
             limit: Annotated[int, typer.Option(help="Show at most this many checkpoints.", min=1,
                                                max=1_000_000)] = 50) -> None:
    """List checkpoints, most recently used first."""
    store = _store(cache_dir)
    rows = store.ls(limit=limit) if store else []
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    typer.echo(f"{'tokens':>8}  {'size':>10}  {'hits':>5}  {'created':16}  {'last used':16}  model")
    for r in rows:
        typer.echo(f"{r.get('num_tokens', 0):>8,}  {_size(r.get('bytes')):>10}  {r.get('hits', 0):>5}  "
                   f"{_when(r.get('created')):16}  {_when(r.get('last_used')):16}  {r.get('model', '')}")
    if not rows:
        typer.echo("(no checkpoints yet)")


@cache_app.command("verify")
def cache_verify(cache_dir: CacheDirOpt = None) -> None:
    """Check every blob against its checksum; remove entries that fail (a blob that cannot be
    read, for its permissions say, is reported and kept)."""
    store = _store(cache_dir)
    report = store.verify() if store else {}
    unreadable = report.get("unreadable") or []
    typer.echo(f"checked {report.get('checked', 0):,}; ok {report.get('ok', 0):,}; "
               f"removed {len(report.get('removed') or []):,}"
               + (f"; unreadable, kept {len(unreadable):,}" if unreadable else ""))
    for item in report.get("removed") or []:
        typer.echo(f"  removed {item}")
    for item in unreadable:
        typer.echo(f"  unreadable (kept) {item}")


@cache_app.command("gc")
def cache_gc(cache_dir: CacheDirOpt = None,
             max_bytes: Annotated[int | None, typer.Option("--max-bytes", help="Evict least recently "
                                  "used entries until the cache is at most this size (default: "
                                  "the configured budget).")] = None) -> None:
    """Evict least recently used entries down to the byte budget."""
    if max_bytes is not None and max_bytes < 0:
        raise StatechatError("--max-bytes must be >= 0")
    store = _store(cache_dir)
    typer.echo(f"freed {_size(store.gc(max_bytes) if store else 0)}")


@cache_app.command("clear")
def cache_clear(cache_dir: CacheDirOpt = None,
                yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False) -> None:
    """Delete every cached checkpoint and block (conversations are kept)."""
    store = _store(cache_dir)
    if store is None:
        typer.echo(f"freed {_size(0)}")
        return
    if not yes and not typer.confirm(f"Delete every cache entry in {store.path}?"):
        raise typer.Abort()
    typer.echo(f"freed {_size(store.clear())}")
