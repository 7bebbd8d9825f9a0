"""The `statechat` command line (Typer): thin commands that build a config and call one function.

    statechat run                 the chat app (Textual TUI)
    statechat batch INPUT.jsonl   chat requests in, results out, all batched together
    statechat serve               OpenAI-compatible HTTP API
    statechat cache stats|ls|...  inspect and trim the persistent prefix cache

Known errors print one line (`statechat: ...`); set STATECHAT_DEBUG=1 for the traceback. The
options shared by several commands, and their checks, are in cli_options.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from statechat.cli_options import (
    CacheDirOpt,
    DeviceOpt,
    FrequencyPenaltyOpt,
    JsonOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    NoCacheOpt,
    PresencePenaltyOpt,
    RepetitionPenaltyOpt,
    SeedOpt,
    TemperatureOpt,
    TemplateKwargsOpt,
    TopKOpt,
    TopPOpt,
    compose_sampling,
    parse_template_kwargs,
)
from statechat.errors import StatechatError

app = typer.Typer(
    help="statechat: chat with Qwen3.5 hybrid models, reusing every prefix it has computed.",
    no_args_is_help=True,
    add_completion=False,
)
cache_app = typer.Typer(help="Inspect and trim the persistent prefix cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@app.callback()
def _root() -> None:
    """statechat: chat with Qwen3.5 hybrid models, reusing every prefix it has computed."""


def _config(model: Path | None, cache_dir: Path | None, device: str, no_cache: bool = False):
    from statechat.config import EngineConfig
    from statechat.paths import cache_dir as resolve_cache_dir
    from statechat.paths import default_model

    return EngineConfig(
        model=model or default_model(), device=device, enable_prefix_cache=not no_cache,
        cache_dir=None if no_cache else resolve_cache_dir(cache_dir),
    )


def _engine(config):
    from statechat.engine.engine import LLMEngine

    return LLMEngine(config)


def _warn_if_embedded(model: Path) -> None:
    from statechat.paths import is_embedded

    if is_embedded(model):
        typer.secho("statechat: using the embedded tiny Qwen3.5 with RANDOM weights (replies are "
                    "noise); pass --model DIR with a real Qwen3.5 checkpoint.", fg="yellow", err=True)


# --- run / batch / serve -------------------------------------------------------------------
@app.command()
def run(
    model: ModelOpt = None, cache_dir: CacheDirOpt = None, device: DeviceOpt = "auto",
    no_cache: NoCacheOpt = False, chat_template_kwargs: TemplateKwargsOpt = None,
    temperature: TemperatureOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None,
    min_p: MinPOpt = None, presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None, repetition_penalty: RepetitionPenaltyOpt = None,
    max_tokens: MaxTokensOpt = None,
) -> None:
    """Chat in the terminal app: branching conversations, each reply reporting cache reuse.
    Sampling: temperature 0.7, top-p 0.95, 1,024 tokens, unless the model's generation config
    or the flags say otherwise."""
    from statechat.paths import cache_dir as resolve_cache_dir
    from statechat.tui.app import DEFAULT_SAMPLING, StatechatApp

    config = _config(model, cache_dir, device, no_cache)
    sampling = compose_sampling(  # (reads the model's config: a wrong --model is one line now)
        DEFAULT_SAMPLING, config.model, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, max_tokens=max_tokens)
    chat_app = StatechatApp(config, chat_dir=resolve_cache_dir(cache_dir), sampling=sampling,
                            template_kwargs=parse_template_kwargs(chat_template_kwargs))
    chat_app.run()
    if chat_app.return_code:
        raise typer.Exit(chat_app.return_code)


@app.command()
def batch(
    input: Annotated[Path, typer.Argument(help="JSONL, one request a line: {\"id\", \"messages\", "
                                          "optional \"max_tokens\", \"temperature\", \"top_p\", "
                                          "\"top_k\", \"min_p\", \"presence_penalty\", "
                                          "\"frequency_penalty\", \"repetition_penalty\", "
                                          "\"seed\", \"stop\", \"chat_template_kwargs\"}.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to write the results "
                                                "(JSONL, input order); default stdout.")] = None,
    model: ModelOpt = None, cache_dir: CacheDirOpt = None, device: DeviceOpt = "auto",
    no_cache: NoCacheOpt = False, chat_template_kwargs: TemplateKwargsOpt = None,
    temperature: TemperatureOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None,
    min_p: MinPOpt = None, presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None, repetition_penalty: RepetitionPenaltyOpt = None,
    max_tokens: MaxTokensOpt = None, seed: SeedOpt = None,
) -> None:
    """Run chat requests from a JSONL file together; write one JSON result per line, in order.
    Sampling: greedy, 256 tokens, unless the model's generation config, the flags or a line's
    own fields say otherwise."""
    from statechat.batch import DEFAULT_SAMPLING, BatchDefaults, run_batch

    if not input.is_file():
        raise StatechatError(f"{input} is not a file; pass a JSONL file of chat requests")
    try:
        lines = input.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        raise StatechatError(f"{input} is not UTF-8 text (byte {e.start:,}); save it as UTF-8") from None
    except OSError as e:
        raise StatechatError(f"cannot read {input} ({e.strerror})") from None
    config = _config(model, cache_dir, device, no_cache)
    sampling = compose_sampling(  # (a bad flag: one line now, not an error on every line)
        DEFAULT_SAMPLING, config.model, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, max_tokens=max_tokens, seed=seed)
    defaults = BatchDefaults(sampling, parse_template_kwargs(chat_template_kwargs))
    direct = output is None or _writes_in_place(output, input)  # checked before the model loads
    engine = _engine(config)
    _warn_if_embedded(engine.loaded.path)

    def write(rec: dict) -> None:
        try:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
        except OSError as e:
            raise StatechatError(f"cannot write {output or 'stdout'} ({e.strerror})") from None

    with contextlib.ExitStack() as stack:  # (exits in reverse: the cache flushed, then the file)
        sink = stack.enter_context(_results(output, direct))
        progress = stack.enter_context(_progress_bar())
        task = progress.add_task("batch", total=None)
        stack.callback(getattr(engine, "close", lambda: None))  # flush pending cache writes
        records = run_batch(engine, lines, write, defaults,
                            lambda done, total: progress.update(task, completed=done, total=total))
    failed = sum("error" in r for r in records)
    if failed:  # each has its error record; a run where every one failed is itself a failure
        typer.echo(f"statechat: {failed:,} of {len(records):,} requests failed "
                   '(see their "error" records)', err=True)
        if failed == len(records):
            raise typer.Exit(1)


@contextlib.contextmanager
def _results(output: Path | None, direct: bool):
    """The stream a batch writes: stdout, `output` itself, or a temporary file beside it that
    replaces it when the run ends (an earlier file survives a failed run; none is left)."""
    if output is None or direct:
        with open(output, "w", encoding="utf-8") if output else contextlib.nullcontext(sys.stdout) as f:
            yield f
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        if output.exists():
            shutil.copymode(output, tmp)
        else:  # (mkstemp's file is private: give it the mode a new file gets)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, output)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _writes_in_place(output: Path, input: Path) -> bool:
    """Whether a batch writes `output` itself (a device, a pipe, a link: /dev/stdout, say)
    rather than a file beside it renamed over it at the end; a one-line error for a path
    that cannot take the results."""
    if output.is_dir():
        raise StatechatError(f"{output} is a folder; pass a file name for the results")
    if not output.parent.is_dir():
        raise StatechatError(f"{output.parent} does not exist; create it or write elsewhere")
    if output.exists() and output.resolve() == input.resolve():
        raise StatechatError(f"{output} is the input file; write the results elsewhere")
    if output.is_symlink() or (output.exists() and not output.is_file()) \
            or output.resolve().parts[1:2] in (("dev",), ("proc",)):
        return True
    if not os.access(output.parent, os.W_OK):
        raise StatechatError(f"cannot write in {output.parent}; write the results elsewhere")
    return False


def _progress_bar():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                    transient=False)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).",
                                      envvar="STATECHAT_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", envvar="STATECHAT_PORT", min=0,
                                      max=65535)] = 8000,
    model: ModelOpt = None, cache_dir: CacheDirOpt = None, device: DeviceOpt = "auto",
    no_cache: NoCacheOpt = False,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on "
                                                "every request.", envvar="STATECHAT_API_KEY")] = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    temperature: TemperatureOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None,
    min_p: MinPOpt = None, presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None, repetition_penalty: RepetitionPenaltyOpt = None,
    max_tokens: MaxTokensOpt = None,
) -> None:
    """Serve an OpenAI-compatible API: /v1/chat/completions, /v1/models, /health. Sampling:
    temperature 1, top-p 1 (OpenAI's), 2,048 tokens, unless the model's generation config, the
    flags or a request's own fields say otherwise."""
    from statechat.api_request import DEFAULT_SAMPLING
    from statechat.engine.worker import EngineWorker
    from statechat.server import serve as serve_forever

    template_kwargs = parse_template_kwargs(chat_template_kwargs)
    config = _config(model, cache_dir, device, no_cache)
    sampling = compose_sampling(
        DEFAULT_SAMPLING, config.model, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, max_tokens=max_tokens)
    engine = _engine(config)
    _warn_if_embedded(engine.loaded.path)
    try:
        serve_forever(EngineWorker(engine), engine.loaded.path.name, host, port, api_key,
                      template_kwargs, sampling)
    except OSError as e:
        raise StatechatError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None


# --- cache ----------------------------------------------------------------------------------
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


def main() -> None:
    """Entry point: run the Typer app, turning known errors into one line."""
    try:
        code = app(standalone_mode=False)  # a raised typer.Exit comes back as its exit code
    except StatechatError as e:
        if os.environ.get("STATECHAT_DEBUG") == "1":
            raise
        typer.secho(f"statechat: {e}", fg="red", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:
        # usage errors of Typer's click: they know how to show themselves
        if callable(getattr(e, "show", None)) and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
