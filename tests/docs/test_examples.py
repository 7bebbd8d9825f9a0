"""The code blocks of README.md, docs/app.md and docs/cache-schema.md work as a user would copy
them. The Python blocks run, in the order the pages give them, in one fresh folder against the
embedded tiny model: the engine API's example (generate with n samples, a stop string kept,
special tokens shown, stream) writes a real cache there, and the blob checksum recipe gives the
checksum statechat wrote into a blob of that cache. Every `sqlite3` and `sqlite-utils` query
runs on that cache's index.db. A block that only illustrates (a synopsis, a picture, a command
that needs a real model, a GPU or the network) is marked `<!-- not run: reason -->` right
before its fence and is skipped with that reason; any other block this file cannot run fails,
so a new example is either run here or says why not. Fails when an example breaks."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sqlite3
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from statechat.cache.index import connect

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/app.md", "docs/cache-schema.md")
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the fence's line, 1-based
    lang: str
    text: str
    not_run: str | None  # the marker's reason

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(root: Path = ROOT) -> list[Block]:
    """Every fenced block of the pages, in order, with the `not run` marker before it if any."""
    found = []
    for page in PAGES:
        lines = (root / page).read_text().splitlines()
        i = 0
        while i < len(lines):
            opened = FENCE.match(lines[i])
            if opened is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
            reason = marker.group(1) if marker else None
            if page == "README.md" and not found:  # (the page opens with it: no marker there)
                reason = "the set-up commands (network, the terminal app): test_cli_doc.py"
            found.append(Block(page, i + 1, opened.group(1), "\n".join(lines[i + 1 : end]),
                               reason))
            i = end + 1
    return found


BLOCKS = blocks()


def blob_tensor_bytes(folder: Path) -> tuple[dict[str, bytes], str]:
    """A blob of the cache the examples made: {tensor name: raw bytes}, and its checksum."""
    path = next(folder.glob("**/blobs/ckpt/*/*.safetensors"))
    with safe_open(str(path), "pt") as f:
        data = {n: f.get_tensor(n).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                for n in f.keys()}  # noqa: SIM118 - (safe_open is not a mapping)
        return data, f.metadata()["checksum"]


def run_python(block: Block, folder: Path) -> str | None:
    """Run a Python block in `folder`; None, or what went wrong. A name the page's prose gives
    the block (`tensor_bytes`: a blob's tensors) is given, and its result checked."""
    scope: dict = {"__name__": "__example__"}
    expected = None
    if "tensor_bytes" in block.text and not re.search(r"^tensor_bytes\s*=", block.text,
                                                          re.MULTILINE):
        try:
            scope["tensor_bytes"], expected = blob_tensor_bytes(folder)
        except StopIteration:
            return "no checkpoint blob to take tensor_bytes from: the examples before it made none"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            # (padded, so that a traceback's line numbers are the page's)
            code = compile("\n" * block.line + block.text, block.page, "exec")
            exec(code, scope)  # noqa: S102 - the docs' own code
    except Exception:  # noqa: BLE001 - reported as the block's failure
        return traceback.format_exc(limit=-3)
    if expected is not None and scope.get("checksum") != expected:
        return f"checksum {scope.get('checksum')!r}, but the blob's metadata says {expected!r}"
    return None


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, dict[str, str | None]]:
    """The folder the Python blocks ran in (in page order) and {block: None or its failure}."""
    folder = tmp_path_factory.mktemp("examples")
    results: dict[str, str | None] = {}
    with pytest.MonkeyPatch.context() as mp:  # (nothing touches the user's folders)
        mp.chdir(folder)
        for var in ("HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "HF_HOME"):
            mp.setenv(var, str(folder / "home"))
        mp.setenv("STATECHAT_CACHE_DIR", str(folder / "cache-dir"))
        for block in BLOCKS:
            if block.lang == "python" and block.not_run is None:
                results[block.name] = run_python(block, folder)
    return folder, results


def index_db(folder: Path) -> Path:
    """The index.db the Python examples made; else one made by the cache's own schema code."""
    made = sorted(folder.glob("**/index.db"))
    if made:
        return made[0]
    path = folder / "schema-only" / "index.db"
    connect(path).conn.close()
    return path


def sql_of(line: str) -> str:
    """The SQL a `sqlite3 ... index.db 'SQL'` or `sqlite-utils query|rows ...` line runs."""
    words = shlex.split(line)
    if words[0] == "sqlite3" and words[-2].endswith("index.db"):
        return words[-1]
    if words[:2] == ["sqlite-utils", "query"] and words[2].endswith("index.db"):
        return words[3]
    if words[:2] == ["sqlite-utils", "rows"] and words[2].endswith("index.db"):
        limit = words[words.index("--limit") + 1] if "--limit" in words else "-1"
        return f"SELECT * FROM {words[3]} LIMIT {int(limit)}"
    raise AssertionError(f"cannot run `{line}`: make it a sqlite3 or sqlite-utils query on "
                         "index.db, or mark its block <!-- not run: reason -->")


def test_the_pages_have_runnable_examples():
    langs = [b.lang for b in BLOCKS if b.not_run is None]
    assert langs.count("python") >= 2 and "sh" in langs  # (the parser read the pages)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_example(block: Block, ran):
    if block.not_run is not None:
        pytest.skip(block.not_run)
    folder, results = ran
    if block.lang == "python":
        assert results[block.name] is None, f"{block.name} failed:\n{results[block.name]}"
    elif block.lang == "sh":
        db = sqlite3.connect(f"file:{index_db(folder)}?mode=ro", uri=True)
        try:
            for line in filter(None, (x.strip() for x in block.text.splitlines())):
                try:
                    db.execute(sql_of(line)).fetchall()
                except sqlite3.Error as e:
                    raise AssertionError(f"{block.name}: `{line}` fails: {e}") from None
        finally:
            db.close()
    else:
        raise AssertionError(f"{block.name}: a ```{block.lang} block this test cannot run: make "
                             "it a python or sh (sqlite) example, or mark it "
                             "<!-- not run: reason --> right before its fence")


def test_not_run_markers_sit_on_fences():
    """A marker that lost its block (text put between them) would skip nothing."""
    for page in PAGES:
        lines = (ROOT / page).read_text().splitlines()
        for i, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1]), f"{page}:{i + 1}"

