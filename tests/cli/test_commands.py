"""The command line: every command's --help explains its options, and the `cache` commands
report on a cache dir (when the persistent store is part of this build)."""

from __future__ import annotations

import errno
import json
import os

import pytest
from typer.testing import CliRunner

from statechat import cli, cli_setup
from statechat.api_cors import LOCAL_ORIGINS
from statechat.errors import StatechatError
from statechat.paths import EMBEDDED_MODEL

runner = CliRunner()
SAMPLING_FLAGS = ["--temperature", "--top-p", "--top-k", "--min-p", "--presence-penalty",
                  "--frequency-penalty", "--repetition-penalty", "--max-tokens"]
ENGINE_FLAGS = ["--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                "--memory-fraction", "--dtype", "--disk-cache-bytes", "--max-step-ms"]


@pytest.mark.parametrize("argv, needles", [
    ([], ["run", "batch", "serve", "cache", "chats"]),
    (["chats"], ["ls", "show", "export", "rm"]),
    (["run"], ["--model", "--cache-dir", "--device", "--chat-template-kwargs", *SAMPLING_FLAGS,
               *ENGINE_FLAGS]),
    (["batch"], ["--output", "--no-cache", "--seed", "--model", "--chat-template-kwargs",
                 "--reasoning-parser",
                 *SAMPLING_FLAGS, *ENGINE_FLAGS]),
    (["serve"], ["--host", "--port", "--api-key", "STATECHAT_API_KEY", "--allowed-origins",
                  "--served-model-name", "--reasoning-parser", "--model", "--cache-dir",
                 "--chat-template-kwargs", *SAMPLING_FLAGS, *ENGINE_FLAGS]),
    (["cache"], ["path", "stats", "ls", "verify", "gc", "clear"]),
    (["cache", "gc"], ["--max-bytes", "--cache-dir"]),
])
def test_help_explains_options(argv, needles):
    result = runner.invoke(cli.app, [*argv, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for needle in needles:
        assert needle in result.output, f"{needle} missing from `statechat {' '.join(argv)} --help`"


def test_dtype_s_help_names_auto():
    """--dtype takes vLLM's `auto` (the default's choice), and its help says so (it listed the
    three types alone)."""
    result = runner.invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    line = next(line for line in result.output.splitlines() if "--dtype" in line)
    assert "auto | float32 | bfloat16 | float16" in line, line


def test_version():
    from statechat import __version__

    result = runner.invoke(cli.app, ["--version"])
    assert (result.exit_code, result.output) == (0, f"statechat {__version__}\n")


def test_python_dash_m_runs_the_commands():
    """`python -m statechat` for an environment whose scripts are not on PATH (vLLM's and
    mlx-lm's users run theirs so); a known error is the same one line."""
    import subprocess
    import sys

    from statechat import __version__

    run = subprocess.run([sys.executable, "-m", "statechat", "--version"], check=False,
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (0, f"statechat {__version__}\n")
    run = subprocess.run([sys.executable, "-m", "statechat", "batch", "-", "--device", "cpu",
                          "--min-p", "2"], check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("statechat: --min-p must be in [0, 1]")


def test_cache_commands(tmp_path):
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    cache = ["--cache-dir", str(tmp_path)]
    path = runner.invoke(cli.app, ["cache", "path", *cache])
    assert path.exit_code == 0 and path.output.strip() == str(tmp_path)
    stats = runner.invoke(cli.app, ["cache", "stats", "--json", *cache])
    assert stats.exit_code == 0, stats.output
    assert {"num_checkpoints", "bytes_total", "bytes_budget"} <= set(json.loads(stats.output))
    human = runner.invoke(cli.app, ["cache", "stats", *cache])
    assert (human.exit_code, human.output) == (0, f"no cache at {tmp_path}\n")
    for argv in (["ls"], ["ls", "--json"], ["verify"], ["gc", "--max-bytes", "0"],
                 ["clear", "--yes"]):
        result = runner.invoke(cli.app, ["cache", *argv, *cache])
        assert result.exit_code == 0, (argv, result.output)
    assert "checked" in runner.invoke(cli.app, ["cache", "verify", *cache]).output
    assert runner.invoke(cli.app, ["cache", "clear", *cache]).output == \
        f"no cache at {tmp_path}; nothing to delete\n"  # (not asked: there is nothing)


def test_cache_commands_do_not_create_a_missing_cache_dir(tmp_path):
    """The cache commands only read or delete: on a cache dir that does not exist yet they
    report an empty cache (a note on stderr says there is none) and leave no folder behind."""
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    missing = tmp_path / "not-yet"
    cache = ["--cache-dir", str(missing)]
    assert runner.invoke(cli.app, ["cache", "path", *cache]).output.strip() == str(missing)
    stats = runner.invoke(cli.app, ["cache", "stats", "--json", *cache])
    assert stats.exit_code == 0 and json.loads(stats.stdout)["num_checkpoints"] == 0
    made = runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir", str(tmp_path)])
    assert json.loads(stats.stdout).keys() == json.loads(made.stdout).keys()  # the same fields
    assert f"no cache at {missing} yet" in stats.stderr
    for argv, says in ((["stats"], f"no cache at {missing}"), (["ls"], "(no checkpoints yet)"),
                       (["ls", "--json"], "[]"), (["verify"], "checked 0; ok 0; removed 0\n"),
                       (["gc"], "freed 0 B"),
                       (["clear"], f"no cache at {missing}; nothing to delete")):
        result = runner.invoke(cli.app, ["cache", *argv, *cache])
        assert result.exit_code == 0 and says in result.stdout, (argv, result.output)
    assert not missing.exists()


@pytest.mark.parametrize("made", [False, True])
def test_stats_of_a_folder_with_no_cache_says_so_in_one_line(tmp_path, made):
    """`stats` where there is no cache (no folder, or one with no index.db and no blobs/) is
    one line, as `clear` says it (it printed a table of zeros ending `0 B of -`)."""
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    folder = tmp_path / "cache"
    if made:
        folder.mkdir()
    result = runner.invoke(cli.app, ["cache", "stats", "--cache-dir", str(folder)])
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"no cache at {folder}\n", "")
    assert folder.exists() == made and (not made or list(folder.iterdir()) == [])


def test_a_cache_dir_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch, capsys):
    """A file where the cache folder should be, an index that is not a database, or a folder
    where the index should be: one line that says what to do, from every cache command (they
    were SQLite tracebacks)."""
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "index.db").write_bytes(b"not a database at all" * 100)
    folder = tmp_path / "folder"
    (folder / "index.db").mkdir(parents=True)  # (it said: check the folder's permissions)
    for cache_dir, says in [(a_file, "is a file; pass a folder"),
                            (garbage, "file is not a database"),
                            (folder, f"{folder / 'index.db'} is a folder; move it away")]:
        for command in ("stats", "ls", "verify"):
            monkeypatch.setattr("sys.argv",
                                ["statechat", "cache", command, "--cache-dir", str(cache_dir)])
            with pytest.raises(SystemExit) as exit_info:
                cli.main()
            err = capsys.readouterr().err.strip()
            assert exit_info.value.code == 2 and says in err and "\n" not in err, (command, err)
    assert (garbage / "index.db").read_bytes().startswith(b"not a database")  # left as it was


@pytest.mark.parametrize("argv, says", [
    (["run", "--device", "tpu"], "unknown device 'tpu'; choose one of auto, cpu, cuda, npu"),
    (["serve", "--device", "tpu"], "unknown device 'tpu'; choose one of auto, cpu, cuda, npu"),
    (["run", "--model", "/nonexistent"], "model directory /nonexistent does not exist"),
    (["run", "--memory-fraction", "2"], "--memory-fraction must be in [0.05, 0.98], got 2.0"),
    (["serve", "--dtype", "float64"],
     "--dtype must be auto, float32, bfloat16 or float16, got 'float64'"),
    (["run", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["serve", "--max-model-len", "1"], "--max-model-len must be at least 2 tokens, got 1"),
    (["serve", "--max-step-ms", "-5"], "--max-step-ms must be 0 (off) or more, got -5.0"),
    (["run", "--max-num-batched-tokens", "32"],
     "--max-num-batched-tokens must be at least one block (64 tokens), got 32"),
    (["run", "--model", str(EMBEDDED_MODEL), "--max-model-len", "100000"],
     "--max-model-len 100,000 exceeds the model's 8,192 positions; lower --max-model-len"),
    (["serve", "--model", str(EMBEDDED_MODEL), "--max-model-len", "100000"],
     "--max-model-len 100,000 exceeds the model's 8,192 positions; lower --max-model-len"),
    (["serve", "--chat-template-kwargs", '{"tokenize": false}'],
     "--chat-template-kwargs may not set tokenize"),
    (["run", "--disk-cache-bytes", "20 gigs"],
     "--disk-cache-bytes must be a size such as 500M, 20G or a byte count, got '20 gigs'"),
    (["serve", "--disk-cache-bytes", "-1G"],
     "--disk-cache-bytes must be a size such as 500M, 20G or a byte count, got '-1G'"),
    (["serve", "--reasoning-parser", "deepseek_r1"],
     "--reasoning-parser must be qwen3, got 'deepseek_r1'"),
    (["batch", str(EMBEDDED_MODEL / "config.json"), "--reasoning-parser", "Qwen3"],
     "--reasoning-parser must be qwen3, got 'Qwen3'"),
    (["batch", str(EMBEDDED_MODEL / "config.json"), "--chat-template-kwargs",
      '{"messages": [], "add_generation_prompt": true}'],
     "--chat-template-kwargs may not set add_generation_prompt, messages"),
])
def test_a_wrong_device_or_model_is_one_line_before_anything_starts(argv, says, monkeypatch,
                                                                    capsys):
    """(`run` showed its loading screen first, and took the error from its worker thread;
    `serve` and `batch` loaded the model before a --max-model-len past its positions; a
    --chat-template-kwargs naming a variable the renderer takes itself was told as a
    request's "chat_template_kwargs", which the command line has not.)"""
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"statechat: {says}"


def test_batch_help_lists_every_field_a_line_may_set():
    """`batch --help` names every field batch reads from a line (it left four out, then "n"
    and "include_reasoning"); "model" alone is read past (the loaded model answers)."""
    from statechat.batch_lines import LINE_FIELDS, OTHER_FIELDS

    result = runner.invoke(cli.app, ["batch", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    for field in (*LINE_FIELDS, *OTHER_FIELDS):
        assert field == "model" or f'"{field}"' in result.output, field


def warm_cache(tmp_path, *flags: str):
    """A cache dir with checkpoints and KV blocks, written by a batch of two long prompts run
    with `flags`."""
    src, cache = tmp_path / "in.jsonl", tmp_path / "cache"
    src.write_text("".join(json.dumps({"messages": [{"role": "user",
                                                     "content": "cache " * (80 + i)}],
                                       "max_tokens": 2}) + "\n" for i in range(2)))
    result = runner.invoke(cli.app, ["batch", str(src), "-o", str(tmp_path / "out.jsonl"),
                                     "--model", str(EMBEDDED_MODEL), "--device", "cpu",
                                     "--cache-dir", str(cache), *flags])
    assert result.exit_code == 0, result.output
    assert len(list((cache / "blobs").rglob("*.safetensors"))) >= 2
    assert sorted(p.name for p in cache.iterdir()) == ["blobs", "index.db"]
    return cache


def files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_stats_and_ls_create_nothing(tmp_path, shared_engine):
    """`stats`, `ls` (and `verify` with nothing to remove) make no file: not an index.db in an
    empty cache dir (they made a 45 KB one), not a byte in a cache that has one."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cache = warm_cache(tmp_path)
    before = files(cache)
    for folder in (empty, cache):
        for argv in (["stats"], ["stats", "--json"], ["ls"], ["verify"]):
            result = runner.invoke(cli.app, ["cache", *argv, "--cache-dir", str(folder)])
            assert result.exit_code == 0, (argv, result.output)
    assert list(empty.iterdir()) == []
    assert files(cache) == before
    stats = json.loads(runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir",
                                               str(cache)]).stdout)
    assert stats["num_checkpoints"] >= 1 and stats["num_blocks"] >= 1


@pytest.fixture
def read_only_view(tmp_path):
    """A read-only view of a folder: the folder itself with its files and folders made
    read-only (restored after the test), or, where file modes do not stop this user (root), a
    read-only bind mount of it, skipped where mount is not allowed."""
    import subprocess

    view = tmp_path / "ro"
    view.mkdir()
    undo = []

    def restore():
        for path, mode in reversed(undo):
            if mode is None:
                subprocess.run(["umount", str(path)], check=False)
            else:
                path.chmod(mode)
        undo.clear()

    def make(folder):
        for path in reversed([folder, *folder.rglob("*")]):  # (files before their folders)
            undo.append((path, path.stat().st_mode))
            path.chmod(path.stat().st_mode & ~0o222)
        try:
            (folder / ".probe").touch()
        except PermissionError:
            return folder
        (folder / ".probe").unlink()
        restore()
        done = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(view)],
                              capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip("cannot make a read-only view here (file modes do not stop this user, "
                        "and mount is not allowed)")
        undo.append((view, None))
        return view

    yield make
    restore()


def test_a_cache_on_read_only_media_can_be_inspected(tmp_path, shared_engine, read_only_view):
    """stats and ls read a cache on a read-only mount (they said `cannot open .../index.db`);
    verify checks it and reports, removing nothing; gc and clear refuse in one line."""
    cache = warm_cache(tmp_path)
    orphan = cache / "blobs" / "kv" / f"{'ab' * 16}.safetensors"
    orphan.write_bytes(b"x")
    os.utime(orphan, (1e9, 1e9))
    want = json.loads(runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir",
                                              str(cache)]).stdout)
    listed = runner.invoke(cli.app, ["cache", "ls", "--json", "--cache-dir", str(cache)]).stdout
    before = files(cache)
    view = read_only_view(cache)
    ro = ["--cache-dir", str(view)]
    stats = runner.invoke(cli.app, ["cache", "stats", "--json", *ro])
    assert stats.exit_code == 0, stats.output
    got = json.loads(stats.stdout)
    assert [got[k] for k in ("num_checkpoints", "num_blocks", "bytes_total")] == \
        [want[k] for k in ("num_checkpoints", "num_blocks", "bytes_total")]
    assert runner.invoke(cli.app, ["cache", "ls", "--json", *ro]).stdout == listed
    verify = runner.invoke(cli.app, ["cache", "verify", *ro])
    assert verify.exit_code == 4, verify.output  # (found, and left: the cache is read-only)
    assert f"ok {want['num_checkpoints'] + want['num_segments']}" in verify.stdout
    assert "found 1 orphan blob (no index row points at it; kept: the cache is read-only)" \
        in verify.stdout
    for argv in (["gc"], ["clear", "--yes"], ["clear"]):
        result = runner.invoke(cli.app, ["cache", *argv, *ro])
        assert (result.exit_code != 0
                and "is read-only; nothing was deleted" in str(result.exception))
    assert files(cache) == before


def test_an_engine_on_a_read_only_cache_says_what_to_do(tmp_path, shared_engine,
                                                        read_only_view, monkeypatch, capsys):
    """An engine cannot run on a cache it cannot write to: one line that says why, with no
    advice to move a sound index away (it said "check the folder's permissions, or move the
    file away to start afresh" on read-only media too)."""
    view = read_only_view(warm_cache(tmp_path))
    readonly_fs = os.statvfs(view).f_flag & os.ST_RDONLY
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(tmp_path / "in.jsonl"), "-o",
                                     str(tmp_path / "out.jsonl"), "--model", str(EMBEDDED_MODEL),
                                     "--device", "cpu", "--cache-dir", str(view)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert err.startswith(f"statechat: cannot open {view / 'index.db'} (") and "move" not in err
    assert err.endswith("its folder is on a read-only file system: pick a cache dir you can "
                        "write to" if readonly_fs else "check the folder's permissions"), err


def test_verify_reports_the_orphan_blobs_it_removes(tmp_path, shared_engine):
    """An index that was lost (truncated) leaves every blob an orphan: verify removes them and
    says so, each by name (it deleted them all and printed `removed 0`)."""
    cache = warm_cache(tmp_path)
    blobs = sorted(p.relative_to(cache / "blobs").as_posix()
                   for p in (cache / "blobs").rglob("*.safetensors"))
    for name in blobs:
        os.utime(cache / "blobs" / name, (1e9, 1e9))  # (older than a writer's grace period)
    (cache / "index.db").write_bytes(b"")
    result = runner.invoke(cli.app, ["cache", "verify", "--cache-dir", str(cache)])
    assert result.exit_code == 1, result.output  # (it removed them)
    lines = result.stdout.splitlines()
    assert lines[0] == "checked 0; ok 0; removed 0"
    assert lines[1].startswith(f"removed {len(blobs)} orphan blobs (")
    assert lines[1].endswith("; no index row points at them)")
    assert lines[2:] == [f"  removed orphan {name}" for name in blobs]
    assert list((cache / "blobs").rglob("*.safetensors")) == []


def test_verify_names_the_checkpoints_a_damaged_segment_leaves_without_blocks(tmp_path,
                                                                             shared_engine):
    """A damaged first segment takes every checkpoint standing on it: verify names each, and
    exits 1 (the cache is sound now); a verify after it finds nothing."""
    import sqlite3

    cache = warm_cache(tmp_path)
    db = sqlite3.connect(cache / "index.db")
    (first,) = db.execute("SELECT s.blob FROM segments s JOIN blocks b ON b.segment_id = s.id "
                          "WHERE b.position = 0").fetchone()
    # (both prompts start alike: every checkpoint stands on the first block)
    standing = [r[0] for r in db.execute("SELECT blob FROM checkpoints")]
    db.close()
    assert standing
    segment = cache / "blobs" / first
    raw = bytearray(segment.read_bytes())
    raw[-1] ^= 0xFF
    segment.write_bytes(bytes(raw))
    result = runner.invoke(cli.app, ["cache", "verify", "--cache-dir", str(cache)])
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    them = "it" if len(standing) == 1 else "them"
    what = "checkpoint" if len(standing) == 1 else "checkpoints"
    at = lines.index(f"removed {len(standing)} {what} whose blocks are gone (no request could "
                     f"resume from {them})")
    assert sorted(lines[at + 1:]) == sorted(f"  removed {blob}" for blob in standing)
    again = runner.invoke(cli.app, ["cache", "verify", "--cache-dir", str(cache)])
    assert again.exit_code == 0 and "whose blocks are gone" not in again.stdout, again.output


@pytest.mark.parametrize("answer", ["n\n", "", "maybe\nno\n"])
def test_declining_clear_deletes_nothing_and_says_so(tmp_path, shared_engine, answer):
    """No, or no answer at all (end of input), is one line and exit status 1 (it was 130 and
    nothing said, as if Ctrl-C had been pressed)."""
    cache = warm_cache(tmp_path)
    before = files(cache)
    result = runner.invoke(cli.app, ["cache", "clear", "--cache-dir", str(cache)], input=answer)
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == "Aborted: nothing deleted."  # (after the question)
    assert files(cache) == before
    agreed = runner.invoke(cli.app, ["cache", "clear", "--cache-dir", str(cache)], input="y\n")
    assert agreed.exit_code == 0 and "freed" in agreed.stdout
    assert list((cache / "blobs").rglob("*.safetensors")) == []


def test_the_command_list_shows_each_command_s_summary_alone():
    """`statechat --help` lists each command with its one-sentence summary (it showed whole
    docstrings, broken mid-sentence where their source lines end)."""
    result = runner.invoke(cli.app, ["--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0
    assert "Sampling" not in result.output
    assert "Run chat requests from a JSONL file together; one JSON result per line, in order." \
        in result.output


def test_clear_counts_the_blob_files_it_deletes(tmp_path):
    """A cache whose index was lost still has its blob files: clear deletes them and says how
    many bytes (it said `freed 0 B`, counting index rows only)."""
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    kept = tmp_path / "blobs" / "notes.txt"  # (not named as a blob: stays)
    for i, size in enumerate((1000, 2000)):
        blob = tmp_path / "blobs" / "kv" / f"{i:032x}.safetensors"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(b"x" * size)
    kept.write_text("mine")
    result = runner.invoke(cli.app, ["cache", "clear", "--yes", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0 and result.stdout == "freed 2.9 KiB\n", result.output
    assert [p.name for p in (tmp_path / "blobs").rglob("*")] == ["notes.txt"]
    assert not (tmp_path / "index.db").exists()


@pytest.mark.parametrize("count, says", [
    (1, "removed 1 orphan blob (10 B; no index row points at it)"),
    (2, "removed 2 orphan blobs (20 B; no index row points at them)"),
])
def test_verify_names_one_orphan_blob_in_the_singular(tmp_path, count, says):
    """(One orphan was `no index row points at them`.)"""
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    for i in range(count):
        blob = tmp_path / "blobs" / "kv" / f"{i:032x}.safetensors"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(b"x" * 10)
        os.utime(blob, (1e9, 1e9))  # (older than a writer's grace period)
    result = runner.invoke(cli.app, ["cache", "verify", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1 and result.stdout.splitlines()[1] == says, result.output


def test_verify_s_exit_status_tells_a_sound_cache_from_a_repaired_one(tmp_path, shared_engine,
                                                                      monkeypatch):
    """0: all was fine; 1: it removed what failed (fsck's "errors corrected"); 4: it found
    what it left (a blob it could not read); 5: both. (It exited 0 after removing entries.)"""
    from statechat.cache.blobs import BlobError
    from statechat.cache.store import verify as verify_module

    cache = warm_cache(tmp_path)
    verify = ["cache", "verify", "--cache-dir", str(cache)]
    assert runner.invoke(cli.app, verify).exit_code == 0
    blob = min((cache / "blobs").rglob("*.safetensors"))
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF  # (a flipped byte of its tensors)
    blob.write_bytes(bytes(raw))
    damaged = runner.invoke(cli.app, verify)
    assert damaged.exit_code == 1 and "removed 1" in damaged.stdout, damaged.output
    assert not blob.exists()
    assert runner.invoke(cli.app, verify).exit_code == 0  # (sound again)
    unreadable = min((cache / "blobs").rglob("*.safetensors"))
    read_blob = verify_module.read_blob

    def refused(path, *args, **kwargs):
        if path == unreadable:
            raise BlobError(f"cannot read {path} (Permission denied)", damaged=False)
        return read_blob(path, *args, **kwargs)

    monkeypatch.setattr(verify_module, "read_blob", refused)
    left = runner.invoke(cli.app, verify)
    assert left.exit_code == 4 and "unreadable, kept 1" in left.stdout, left.output
    orphan = cache / "blobs" / "kv" / f"{'cd' * 16}.safetensors"
    orphan.write_bytes(b"x")
    os.utime(orphan, (1e9, 1e9))  # (older than a writer's grace period)
    both = runner.invoke(cli.app, verify)
    assert both.exit_code == 5 and "removed 1 orphan blob" in both.stdout, both.output
    assert unreadable.exists() and not orphan.exists()


def damage_table(index_db, table: str) -> None:
    """Overwrite the first bytes of `table`'s root page in index_db."""
    import sqlite3

    conn = sqlite3.connect(index_db)
    page, = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", [table]).fetchone()
    size, = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    with open(index_db, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(b"\xab" * 200)


def test_a_damaged_index_is_one_line(tmp_path, shared_engine, monkeypatch, capsys):
    """A damaged page in index.db: `verify` and an engine starting on the cache dir (here
    `batch`) say so in one line, exit 2 (they printed a DatabaseError traceback, or verify
    said every entry was ok while the next lookup crashed). The line tells how to save what is
    left of the file, which holds the chats too (it said only to move the file away, which
    hid them)."""
    cache = warm_cache(tmp_path)
    damage_table(cache / "index.db", "blocks")
    src = tmp_path / "in.jsonl"
    for argv in (["cache", "verify"], ["cache", "stats"], ["batch", str(src), "-o",
                                                            str(tmp_path / "out.jsonl")]):
        monkeypatch.setattr("sys.argv", ["statechat", *argv, "--cache-dir", str(cache)])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "\n" not in err, (argv, err)
        assert err == (f"statechat: cannot open {cache / 'index.db'} (database disk image is "
                       f"malformed); `sqlite3 {cache / 'index.db'} .recover | sqlite3 "
                       f"{cache / 'index.db'}.recovered` copies what is left of it (the chats in "
                       "it too) into a file to put in its place, or move the file away to start "
                       "afresh"), argv


def test_a_file_in_place_of_the_blobs_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """(verify ended in a NotADirectoryError traceback.)"""
    pytest.importorskip("statechat.cache.store",
                        reason="the persistent cache store is not in this build")
    (tmp_path / "blobs").write_text("x")
    for command in ("stats", "verify", "gc"):
        monkeypatch.setattr("sys.argv", ["statechat", "cache", command, "--cache-dir",
                                         str(tmp_path)])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and err == (
            f"statechat: {tmp_path / 'blobs'} is a file; move it away (the cache keeps its "
            "blobs in that folder)"), (command, err)
    assert (tmp_path / "blobs").read_text() == "x"


def test_the_cache_command_list_shows_each_summary_alone():
    """`statechat cache --help` lists each command with a one-line summary (it showed whole
    docstrings, broken mid-sentence where their source lines end)."""
    result = runner.invoke(cli.app, ["cache", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0
    rows = [line.strip("│ ").split(None, 1) for line in result.output.splitlines()
            if line.startswith("│ ") and "--help" not in line]
    assert [row[0] for row in rows] == ["path", "stats", "ls", "verify", "gc", "clear"]
    assert all(row[1].rstrip().endswith(".") for row in rows), rows


def test_an_index_another_process_holds_locked_is_not_called_damaged(tmp_path, shared_engine,
                                                                     monkeypatch, capsys):
    """`clear` and `gc` while another process holds index.db in a transaction (a
    `sqlite3` shell inside BEGIN) say that it is locked, and to try again: they said to move
    the index away to start afresh, which loses a sound cache and the chats it holds."""
    import sqlite3

    from statechat.cache import index

    cache = warm_cache(tmp_path)
    before = cache.joinpath("index.db").read_bytes()
    monkeypatch.setattr(index, "BUSY_TIMEOUT_S", 0.1, raising=False)
    holder = sqlite3.connect(cache / "index.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        for command in (["clear", "--yes"], ["gc", "--max-bytes", "0"]):
            monkeypatch.setattr("sys.argv",
                                ["statechat", "cache", *command, "--cache-dir", str(cache)])
            with pytest.raises(SystemExit) as exit_info:
                cli.main()
            err = capsys.readouterr().err.strip()
            assert exit_info.value.code == 2, (command, err)
            assert err == (f"statechat: {cache / 'index.db'} is locked by another process "
                           "(database is locked): a `sqlite3` shell inside a transaction, say; "
                           "try again once it is done"), command
    finally:
        holder.rollback()
        holder.close()
    assert cache.joinpath("index.db").read_bytes() == before


@pytest.mark.parametrize("host, code, fix, where", [
    ("192.0.2.1", errno.EADDRINUSE, "pick another --port", "192.0.2.1:8000"),
    ("192.0.2.1", errno.EADDRNOTAVAIL, "check --host", "192.0.2.1:8000"),
    ("2001:db8::1", errno.EADDRNOTAVAIL, "check --host", "[2001:db8::1]:8000"),
])
def test_serve_that_cannot_listen_says_which_flag_to_change(monkeypatch, host, code, fix, where):
    """A port in use asks for another --port; an address this machine does not have asks to
    check --host (it asked for another port as well). An IPv6 address is bracketed, so that
    its port stands apart (it read "2001:db8::1:8000")."""
    def bind(host, port):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("statechat.api_serve.bind", bind)
    result = runner.invoke(cli.app, ["serve", "--device", "cpu", "--no-cache", "--model",
                                     str(EMBEDDED_MODEL), "--host", host])
    assert result.exit_code != 0
    assert f"cannot listen on {where} (" in str(result.exception or result.output)
    assert fix in str(result.exception or result.output)


def test_serve_refuses_an_allowed_origin_that_is_not_one(monkeypatch):
    """A bad --allowed-origins is one line naming it, before the model loads."""
    monkeypatch.setattr("statechat.cli_setup.load_engine",
                        lambda config: pytest.fail("the model loaded"))
    result = runner.invoke(cli.app, ["serve", "--device", "cpu", "--no-cache",
                                     "--allowed-origins", "localhost:3000"])
    assert result.exit_code != 0
    assert "--allowed-origins: 'localhost:3000' is not an origin" in str(result.exception
                                                                         or result.output)


def test_serve_hands_its_own_options_to_the_server(shared_engine, monkeypatch):
    """--allowed-origins (this machine's pages, by default), --served-model-name (the
    folder's name by default), --reasoning-parser and --tool-call-parser (none by default)
    reach the server; an empty name, an unknown tool parser and --enable-auto-tool-choice
    without a parser are one line."""
    got = {}

    def serve(worker, model_id, *args, allowed_origins=None, reasoning_parser=None,
              tool_call_parser=None, **kwargs):
        worker.shutdown()
        got["origins"], got["name"], got["parser"] = allowed_origins, model_id, reasoning_parser
        got["tools"] = tool_call_parser

    monkeypatch.setattr("statechat.api_serve.serve", serve)
    args = ["serve", "--device", "cpu", "--no-cache", "--model", str(EMBEDDED_MODEL),
            "--port", "0"]
    assert runner.invoke(cli.app, args).exit_code == 0
    assert got == {"origins": LOCAL_ORIGINS, "name": EMBEDDED_MODEL.name, "parser": None,
                   "tools": None}
    result = runner.invoke(cli.app, [*args, "--allowed-origins",
                                     "http://a.example, http://b.example",
                                     "--served-model-name", "my-model",
                                     "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                                     "--tool-call-parser", "qwen3_coder"])
    assert result.exit_code == 0
    assert got == {"origins": ("http://a.example", "http://b.example"), "name": "my-model",
                   "parser": "qwen3", "tools": "qwen3_coder"}
    for bad, said in (
            (["--tool-call-parser", "hermes"], "--tool-call-parser must be qwen3_coder, got"),
            (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser")):
        result = runner.invoke(cli.app, [*args, *bad])
        assert result.exit_code != 0 and said in str(result.exception or result.output)
    result = runner.invoke(cli.app, [*args, "--served-model-name", " "])
    assert result.exit_code != 0
    assert "--served-model-name must not be empty" in str(result.exception or result.output)


def test_a_port_in_use_is_one_line_before_the_model_loads(monkeypatch, capsys):
    """`serve --port P` with P taken loaded the whole model (minutes, for a large one) before it
    said so; vLLM's server binds its port first. Now the port is bound before the model loads,
    and a port in use is the one line at once."""
    import socket

    def no_load(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_setup, "load_engine", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr("sys.argv", ["statechat", "serve", "--device", "cpu", "--no-cache",
                                         "--model", str(EMBEDDED_MODEL), "--port", str(port)])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"statechat: cannot listen on 127.0.0.1:{port} (Address already in use); pick another "
        "--port")


def test_run_without_a_terminal_is_one_line_not_a_hang(monkeypatch, capsys):
    """`statechat run` with no terminal to read keys from (`ssh host statechat run` without
    -t, nohup, cron: standard input /dev/null) started the app anyway, which waited for keys
    forever while it drew into whatever took its output. Now it says what to use instead,
    before the model loads."""
    pytest.importorskip("textual")
    made = []

    class App:
        def __init__(self, *args, **kwargs) -> None:
            made.append(self)

    monkeypatch.setattr("statechat.tui.app.StatechatApp", App)
    with open(os.devnull) as no_keys:
        monkeypatch.setattr("sys.stdin", no_keys)
        monkeypatch.setattr("sys.argv", ["statechat", "run", "--device", "cpu", "--no-cache",
                                         "--model", str(EMBEDDED_MODEL)])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
    assert exit_info.value.code == 2 and not made
    assert capsys.readouterr().err.strip() == (
        "statechat: run is the terminal app: it reads keys from standard input and draws on "
        "standard error, and here they are not a terminal; for scripts use `statechat batch` "
        "or `statechat serve`")


def test_a_port_taken_while_the_model_loads_is_one_line(monkeypatch, capsys, loaded):
    """The port is bound, not yet listened on, while the model loads; a server that starts
    listening on it meanwhile makes the listen fail: that is the same one line, not a
    traceback. (Only where serve's bind had to share the port, SO_REUSEADDR, as after a
    stopped server whose connections wait out TIME_WAIT: `held` stands for them.)"""
    import socket

    from statechat.engine.engine import LLMEngine

    other, held = socket.socket(), socket.socket()
    for sock in (other, held):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def load_while_another_listens(config):
        other.bind(("127.0.0.1", port))
        other.listen()
        return LLMEngine(config, loaded=loaded)

    with socket.socket() as probe:  # (a free port)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    held.bind(("127.0.0.1", port))
    monkeypatch.setattr(cli_setup, "load_engine", load_while_another_listens)
    monkeypatch.setattr("sys.argv", ["statechat", "serve", "--device", "cpu", "--no-cache",
                                     "--model", str(EMBEDDED_MODEL), "--port", str(port)])
    with other, held, pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"statechat: cannot listen on 127.0.0.1:{port} (Address already in use); pick another "
        "--port")


def test_an_os_error_while_serving_is_not_told_as_a_listen_error(shared_engine, monkeypatch):
    """Only the server's listen is told as "cannot listen on ..."; an OSError while it serves
    or stops (a disk's error as the cache closes) is not that port's fault."""
    def serve(worker, *args, **kwargs):
        worker.shutdown()
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr("statechat.api_serve.serve", serve)
    result = runner.invoke(cli.app, ["serve", "--device", "cpu", "--no-cache", "--model",
                                     str(EMBEDDED_MODEL), "--port", "0"])
    assert isinstance(result.exception, OSError) and result.exception.errno == errno.EIO


@pytest.mark.parametrize("argv, flags", [
    ([], ["--version", "--help"]),
    (["batch"], ["--no-cache", "--help"]),
    (["cache"], ["--help"]),
    (["cache", "ls"], ["--json", "--help"]),
    (["cache", "clear"], ["--yes", "--help"]),
])
def test_help_shows_no_value_beside_a_flag(argv, flags):
    """A flag takes no value, so its --help line shows none (typer's help wrote `<bool>` there,
    as though `--no-cache true` were the way to give it); options that take one keep theirs."""
    result = runner.invoke(cli.app, [*argv, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.output.splitlines()
             if len(line.split()) > 1 and line.split()[1].startswith("--")}
    for flag in flags:
        assert "<bool>" not in lines[flag], lines[flag]
    if argv == ["batch"]:
        assert "<path>" in lines["--output"] and "<float>" in lines["--temperature"]


@pytest.mark.parametrize("command", ["run", "batch", "serve"])
def test_a_file_in_place_of_the_cache_dir_is_one_line_before_the_model_loads(
        tmp_path, monkeypatch, capsys, command):
    """A cache dir that is a file, or lies under one, is one line that says so before the model
    loads (the engine loaded the model, then said `cannot open FILE/sub/index.db (Not a
    directory); check the folder's permissions`)."""
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder\n")
    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for cache_dir in (blocker, blocker / "cache"):
        argv = [command, *([str(src)] if command == "batch" else []), "--cache-dir",
                str(cache_dir), "--model", str(EMBEDDED_MODEL), "--device", "cpu"]
        monkeypatch.setattr("sys.argv", ["statechat", *argv])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == (f"statechat: {blocker} is a file; pass a "
                                                   "folder as --cache-dir")
    assert blocker.read_text() == "not a folder\n"


def test_ls_says_when_it_shows_fewer_checkpoints_than_the_cache_holds(tmp_path, shared_engine):
    """`ls --limit N` on a cache with more checkpoints says, on stderr, how many it left out (its
    table looked whole: `cache ls | wc -l` counted 50 of any larger cache); a listing of them
    all says nothing more."""
    src, cache = tmp_path / "in.jsonl", ["--cache-dir", str(tmp_path / "cache")]
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{word} " * 80}],
                                       "max_tokens": 1}) + "\n" for word in ("cache", "state")))
    assert runner.invoke(cli.app, ["batch", str(src), "-o", str(tmp_path / "out.jsonl"),
                                   "--model", str(EMBEDDED_MODEL), "--device", "cpu",
                                   *cache]).exit_code == 0
    total = json.loads(runner.invoke(cli.app, ["cache", "stats", "--json", *cache]).stdout)[
        "num_checkpoints"]
    assert total >= 2
    for argv in ([], ["--json"]):
        cut = runner.invoke(cli.app, ["cache", "ls", "--limit", "1", *argv, *cache])
        assert cut.exit_code == 0, cut.output
        assert cut.stderr == (f"statechat: showing the 1 most recently used of {total:,} "
                              "checkpoints; --limit N shows more\n")
        whole = runner.invoke(cli.app, ["cache", "ls", "--limit", str(total), *argv, *cache])
        assert whole.exit_code == 0 and whole.stderr == ""
    assert len(json.loads(cut.stdout)) == 1


def foreign_index(cache_dir, tables: list[str], version: int):
    """An index.db of another program in `cache_dir`: `tables`, and its own schema version."""
    import sqlite3

    path = cache_dir / "index.db"
    other = sqlite3.connect(path)
    for table in tables:
        other.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, text TEXT)")
    other.execute(f"PRAGMA user_version = {version}")
    other.commit()
    other.close()
    return path


@pytest.mark.parametrize("tables, version", [(["notes"], 0), (["notes"], 7), ([], 7)])
@pytest.mark.parametrize("command", [["verify"], ["gc"], ["clear", "--yes"], ["stats"]])
def test_an_index_db_of_another_program_is_left_as_it_is(tmp_path, monkeypatch, capsys, command,
                                                         tables, version):
    """A cache dir whose index.db is another program's SQLite file (tables of its own, or a
    schema version of its own): the commands say so in one line and leave the file as it was
    (those that write added statechat's tables to it and switched it to WAL; with a version
    and no tables, every command said `no such table` and to check the folder's
    permissions)."""
    path = foreign_index(tmp_path, tables, version)
    before = path.read_bytes()
    monkeypatch.setattr("sys.argv", ["statechat", "cache", *command, "--cache-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:  # (`stats`, reading alone, too: it called a
        # file of no version an index with no rows yet)
        cli.main()
    why = ("it holds other tables: notes" if tables else
           "it has a schema version of another program's, 7")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"statechat: {path} is not a statechat cache index ({why}); pick another cache dir")
    assert path.read_bytes() == before


def test_an_index_db_that_holds_only_the_chats_is_statechat_s(tmp_path, monkeypatch, capsys):
    """`run --no-cache` keeps its chats in the cache dir's index.db, without the cache's tables
    (or their schema version): the cache then opens it as its own, and a table a user added to
    a real index stays."""
    import sqlite3

    from statechat.cache.store import open_store
    from statechat.chat.tree import open_chats

    open_chats(tmp_path).close()
    open_store(tmp_path).close()  # (it was refused as another program's file)
    mine = sqlite3.connect(tmp_path / "index.db")
    mine.execute("CREATE TABLE my_notes (text TEXT)")
    mine.commit()
    mine.close()
    monkeypatch.setattr("sys.argv", ["statechat", "cache", "verify", "--cache-dir", str(tmp_path)])
    cli.main()  # (no SystemExit: a sound cache)
    assert capsys.readouterr().out.startswith("checked 0; ok 0")


@pytest.mark.parametrize("tables, version", [(["models", "runs"], 3), (["models"], 0)])
def test_a_file_with_a_table_named_like_the_index_s_is_still_another_program_s(
        tmp_path, monkeypatch, capsys, tables, version):
    """A table named `models` is common: with a version of its own or none, a file holding one
    (and none of the index's other tables) is another program's too (`cache gc` said `no such
    table`, or ended in a traceback from sqlite-utils, and switched the file to WAL)."""
    path = foreign_index(tmp_path, tables, version)
    before = path.read_bytes()
    for command in (["gc"], ["stats"]):
        monkeypatch.setattr("sys.argv", ["statechat", "cache", *command, "--cache-dir",
                                         str(tmp_path)])
        with pytest.raises(SystemExit) as exit_info:  # (`stats` too, of a file of no version)
            cli.main()
        assert exit_info.value.code == 2
        why = ("it holds other tables: runs" if "runs" in tables else
               "its tables are not the index's")
        assert capsys.readouterr().err.strip().endswith(f"({why}); pick another cache dir")
    assert path.read_bytes() == before


def test_the_chats_leave_another_program_s_index_db_as_it_is(tmp_path):
    """`run --no-cache` keeps its chats in the cache dir's index.db: another program's file
    there is refused in one line, not given the chats' tables and switched to WAL."""
    import sqlite3

    from statechat.chat.tree import open_chats
    from statechat.errors import ConfigError

    other = sqlite3.connect(tmp_path / "index.db")
    other.execute("CREATE TABLE notes (text TEXT)")
    other.commit()
    other.close()
    before = (tmp_path / "index.db").read_bytes()
    with pytest.raises(ConfigError, match="is not a statechat cache index .it holds other "
                                          "tables: notes."):
        open_chats(tmp_path)
    assert (tmp_path / "index.db").read_bytes() == before


@pytest.mark.parametrize("text, size", [
    ("1048576", 1 << 20), ("500M", 500 << 20), ("20G", 20 << 30), ("1.5t", 3 << 39),
    ("64KiB", 64 << 10), ("2GB", 2 << 30), ("0", 0), (" 3K ", 3 << 10),
])
def test_disk_cache_sizes_are_read_in_powers_of_1024(text, size):
    from statechat.cli_options import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "1.5", "10X", "nan", "inf", "-0.5M"])
def test_a_disk_cache_size_that_is_none_is_one_line(text):
    from statechat.cli_options import parse_size

    with pytest.raises(StatechatError, match="^--disk-cache-bytes must be a size such as"):
        parse_size(text)


@pytest.mark.parametrize("text", [str(10**30), "9223372036854775808", "8388608T", "1e400G"])
def test_a_size_past_the_largest_says_so_and_names_the_limit(text, monkeypatch, capsys):
    """(It said `must be a size such as 500M`, of a size.) The largest, 2**63 - 1 bytes, is
    taken as it is."""
    from statechat.cli_options import parse_size

    monkeypatch.setattr("sys.argv", ["statechat", "cache", "gc", "--max-bytes", text])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("statechat: --max-bytes is too large: it takes at most "
                                       f"2**63 - 1 bytes (8 EiB), got {text!r:.40}\n")
    assert parse_size(str(2**63 - 1)) == 2**63 - 1


def test_gc_takes_a_size_with_a_unit(tmp_path, shared_engine):
    """`cache gc --max-bytes` reads sizes as --disk-cache-bytes does (`1K`): the cache is at
    most that size after it; a size it cannot read is one line, and nothing is evicted."""
    cache = warm_cache(tmp_path)

    def total() -> int:
        return json.loads(runner.invoke(cli.app, ["cache", "stats", "--json", "--cache-dir",
                                                  str(cache)]).stdout)["bytes_total"]

    before = total()
    bad = runner.invoke(cli.app, ["cache", "gc", "--max-bytes", "1 kilo", "--cache-dir",
                                  str(cache)])
    assert bad.exit_code != 0 and total() == before > 1024
    assert str(bad.exception).startswith("--max-bytes must be a size such as 500M, 20G or")
    result = runner.invoke(cli.app, ["cache", "gc", "--max-bytes", "1K", "--cache-dir",
                                     str(cache)])
    assert result.exit_code == 0, result.output
    assert total() <= 1024


def test_the_note_of_a_missing_cache_dir_is_statechat_s(tmp_path):
    """(Every other line statechat writes on stderr starts `statechat:`; this one did not, so
    a script's 2> log could not tell it from another program's.)"""
    result = runner.invoke(cli.app, ["cache", "ls", "--cache-dir", str(tmp_path / "no")])
    assert result.stderr == f"statechat: no cache at {tmp_path / 'no'} yet\n"
