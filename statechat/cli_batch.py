"""The files of `statechat batch`: its requests (a JSONL file, or standard input for `-`) and
its results (standard output, or a file written beside its target and renamed over it when the
run ends, so an earlier file survives a failed run; a run stopped early, by Ctrl+C or SIGTERM,
keeps its finished results in FILE.partial). A file that cannot be read or written is one
line: StatechatError, or OutputError (exit status 1) once the run has begun; results whose
reader went away (`| head -1`) end the run quietly (ReaderGone, exit status 141)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import typer

from statechat.errors import ReaderGone, StatechatError

STDIN = Path("-")  # `batch -`: the requests come on standard input


class OutputError(StatechatError):
    """Results that could not be written (a full disk, a device that takes nothing): the run
    failed, so the exit status is 1 (that of a run whose every request failed), not 2."""

    exit_code = 1


class Interrupted(StatechatError):
    """A batch stopped by Ctrl+C (exit status 130) or SIGTERM (143) once its results were
    being written: the message says where the finished ones are."""

    def __init__(self, message: str, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM during a batch, raised as Ctrl+C is so that the finished results are kept."""

    exit_code = 143


@contextlib.contextmanager
def sigterm_interrupts():
    """While the block runs (in the main thread), SIGTERM raises Terminated."""
    def terminate(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # (not the main thread: SIGTERM stays as it was)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def input_name(input: Path) -> str:
    return "standard input" if input == STDIN else str(input)


def read_requests(input: Path) -> list[str]:
    """The lines of a batch's input file (or pipe: bash's `<(...)`), or of standard input for
    `-` (a byte-order mark starting a line is read past); a StatechatError if it cannot be
    read as UTF-8 text.
    Lines end at LF, CRLF or CR alone: not at U+2028, U+0085 and the like, which a JSON string may
    hold as they are."""
    try:
        if input == STDIN:
            if sys.stdin is None:
                raise StatechatError("standard input is closed; pass a JSONL file of chat requests")
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
        elif not input.exists() or input.is_dir():
            why = "is a folder" if input.is_dir() else "does not exist"
            raise StatechatError(f"{input} {why}; pass a JSONL file of chat requests "
                                 "('-' reads them from standard input)")
        else:
            data = input.read_bytes()
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        # (a byte-order mark starting any line is read past: files saved by an editor that
        # writes one, joined with `cat`, have one at each file's first line)
        return [line.removeprefix("\ufeff") for line in re.split("\r\n|\r|\n", text)]
    except UnicodeDecodeError as e:
        line = len(re.split(rb"\r\n|\r|\n", e.object[:e.start]))  # (as the lines are split)
        raise StatechatError(f"{input_name(input)} is not UTF-8 text (line {line:,}, byte "
                             f"{e.start:,}); save it as UTF-8") from None
    except OSError as e:
        raise StatechatError(f"cannot read {input_name(input)} ({e.strerror})") from None


@contextlib.contextmanager
def results(output: Path | None, direct: bool):
    """The stream a batch writes: stdout, `output` itself, or a temporary file beside it that
    replaces it when the run ends (an earlier file survives a failed run; none is left). A
    write that fails is one line (OutputError)."""
    if output is None:
        try:
            with said_when_stopped(Counted(sys.stdout), "went to standard output") as sink:
                yield sink
        except OutputError:  # (what stdout still buffers would fail again as Python exits;
            # for ReaderGone, cli.main does this)
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise
        return
    if direct:
        with closing(output_call(output, open, output, "w", encoding="utf-8"), output) as f, \
                said_when_stopped(Counted(f), f"are in {output}") as sink:
            yield sink
        return
    fd, tmp = output_call(output, tempfile.mkstemp, suffix=".partial", dir=output.parent,
                          prefix=f".{fitted(output, len('..') + 8 + len('.partial'))}.")
    try:
        with closing(os.fdopen(fd, "w", encoding="utf-8"), output) as f:
            yield f
        output_call(output, give_mode, Path(tmp), output)
        output_call(output, os.replace, tmp, output)
    except OutputError:
        raise
    except BaseException as e:  # (Ctrl+C, SIGTERM, a crash: the finished results are kept)
        kept = keep_partial(Path(tmp), output)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"interrupted; {kept}", getattr(e, "exit_code", 130)) from None
        typer.echo(f"statechat: {kept}", err=True)
        raise
    finally:
        Path(tmp).unlink(missing_ok=True)


class Counted:
    """A results stream that counts the lines written to it (one per result)."""

    def __init__(self, stream) -> None:
        self.stream, self.lines = stream, 0

    def write(self, text: str) -> None:
        self.stream.write(text)
        self.lines += text.count("\n")

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def said_when_stopped(sink: Counted, where: str):
    """Yield `sink`; Ctrl+C or SIGTERM meanwhile is Interrupted, whose line says how many
    results went where (`where`: "went to standard output", say), as a results file's does."""
    try:
        yield sink
    except KeyboardInterrupt as e:
        done = f"{_first(sink.lines)} {where}" if sink.lines else "no request had finished"
        raise Interrupted(f"interrupted; {done}", getattr(e, "exit_code", 130)) from None


def give_mode(tmp: Path, output: Path) -> None:
    """Give the results file `tmp` the mode of the `output` it replaces, else the mode a new
    file gets (mkstemp's file is private)."""
    if output.exists():
        shutil.copymode(output, tmp)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)


def keep_partial(tmp: Path, output: Path) -> str:
    """Keep the results that a run ending early wrote to `tmp` in a visible file beside
    `output` (OUTPUT.partial, or OUTPUT.partial.N when that is taken), leaving `output` as it
    was; what became of them, in words."""
    try:
        count = tmp.read_bytes().count(b"\n")
        if not count:
            return f"no request had finished; {output} is left as it was"
        kept = next(path for n in itertools.count(1)
                    if not (path := partial_path(output, n)).exists())
        give_mode(tmp, kept)
        os.replace(tmp, kept)
    except OSError as e:
        return f"the finished results could not be kept ({e.strerror}); {output} is left as it was"
    return f"{_first(count)} {'is' if count == 1 else 'are'} in {kept}; {output} is left as it was"


def _first(count: int) -> str:
    """The words for a run's first `count` results (one result alone said "results")."""
    return ("the first result" if count == 1 else f"the first {count:,} results") + \
        " (input order)"


def partial_path(output: Path, n: int) -> Path:
    """Where the n-th kept partial results of `output` go: OUTPUT.partial, OUTPUT.partial.2,
    ... (OUTPUT's name cut short where the whole would be too long a name)."""
    end = ".partial" + (f".{n}" if n > 1 else "")
    return output.with_name(fitted(output, len(end)) + end)


def fitted(output: Path, room: int) -> str:
    """`output`'s name, cut short where needed so that `room` more bytes still make a name its
    file system takes (a results file named near the 255-byte limit has a temporary file and a
    FILE.partial beside it)."""
    try:
        most = os.pathconf(output.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    name = output.name
    while name and len(os.fsencode(name)) + room > most:
        name = name[:-1]
    return name


def output_call(output: Path, fn, *args, **kwargs):
    """fn(*args, **kwargs), an OSError of which is the one line `cannot write OUTPUT (why)`
    (a broken pipe: ReaderGone)."""
    try:
        return fn(*args, **kwargs)
    except BrokenPipeError:
        raise ReaderGone() from None
    except OSError as e:
        raise OutputError(f"cannot write {output} ({e.strerror or e})") from None


@contextlib.contextmanager
def closing(f, output: Path):
    """Close the results file `f` when the run ends. After an error (a failed write, say) it is
    closed quietly: flushing what it buffers would fail again and hide the first error's line."""
    try:
        yield f
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        raise
    output_call(output, f.close)


def writes_in_place(output: Path | None, input: Path) -> bool:
    """Whether a batch writes `output` itself (standard output for None; a device, a pipe, a
    link: /dev/stdout, say) rather than a file beside it renamed over it at the end; a
    one-line error for an output that cannot take the results (a closed standard output too:
    Python's sys.stdout is then None)."""
    if output is None:
        if sys.stdout is None:
            raise StatechatError("standard output is closed; pass --output FILE for the results")
        return True
    if output.is_dir():
        raise StatechatError(f"{output} is a folder; pass a file name for the results")
    if not output.parent.is_dir():
        raise StatechatError(f"{output.parent} does not exist; create it or write elsewhere")
    if input != STDIN and output.exists() and output.resolve() == input.resolve():
        raise StatechatError(f"{output} is the input file; write the results elsewhere")
    if output.is_symlink() or (output.exists() and not output.is_file()) \
            or output.resolve().parts[1:2] in (("dev",), ("proc",)):
        return True
    if not os.access(output.parent, os.W_OK):
        raise StatechatError(f"cannot write in {output.parent}; write the results elsewhere")
    return False


def progress_bar():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                    transient=False)


def write_records(sink, output: Path | None, records: list[dict]) -> None:
    """Write result records as JSON lines (flushed: a reader of the file sees each as it
    comes); a failed write is one line (OutputError), a broken pipe ReaderGone."""
    try:
        for rec in records:
            sink.write(json.dumps(rec) + "\n")
        sink.flush()
    except BrokenPipeError:
        raise ReaderGone() from None
    except OSError as e:
        raise OutputError(f"cannot write {output or 'stdout'} ({e.strerror})") from None


def report_failures(records: list[dict]) -> None:
    """Say how many of a batch's requests failed; a run where every one failed is itself a
    failure (exit status 1)."""
    failed = sum("error" in r for r in records)
    if failed:  # each has its error record
        typer.echo(f"statechat: {failed:,} of {len(records):,} requests failed "
                   '(see their "error" records)', err=True)
        if failed == len(records):
            raise typer.Exit(1)
