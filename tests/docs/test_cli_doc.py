"""README.md and docs/app.md tell a user every command's options and variables, and name none
the command line lacks; README.md opens with the two set-up commands, the second of which is
what `.ci/run` runs. Fails when a flag is added, renamed or removed without the docs."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from statechat.cli import app

ROOT = Path(__file__).resolve().parents[2]
# flags the docs name that belong to other programs: pip, `hf download`,
# scripts/make_tiny_model.py, and vLLM's names that app.md compares with ours
OTHERS = {"--index-url", "--local-dir", "--layout", "--moe", "--per-expert", "--shard-size",
          "--tie", "--generation-config", "--gpu-memory-utilization"}


def commands() -> dict[str, object]:
    """{"run": ..., "cache ls": ...}: every command of `statechat`, by its words."""
    found: dict[str, object] = {}

    def walk(command: object, words: list[str]) -> None:
        subcommands = getattr(command, "commands", None)
        if subcommands:
            for name, sub in subcommands.items():
                walk(sub, [*words, name])
        else:
            found[" ".join(words)] = command

    walk(typer.main.get_command(app), [])
    return found


def user_docs() -> str:
    return (ROOT / "README.md").read_text() + (ROOT / "docs" / "app.md").read_text()


def test_every_option_and_variable_is_documented():
    docs = user_docs()
    missing = []
    for words, command in commands().items():
        for param in command.params:
            if param.param_type_name != "option":  # (typer's own click: no isinstance)
                continue
            for flag in param.opts + param.secondary_opts:
                if not re.search(rf"{re.escape(flag)}(?![\w-])", docs):
                    missing.append(f"statechat {words} {flag}")
            if param.envvar and param.envvar not in docs:
                missing.append(f"statechat {words} ${param.envvar}")
    assert not missing, f"not in README.md or docs/app.md: {missing}"


def test_every_documented_flag_exists():
    flags = {"--help", "--version"}
    for command in commands().values():
        for param in command.params:
            flags.update(getattr(param, "opts", []) + getattr(param, "secondary_opts", []))
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", user_docs()))
    assert named - flags - OTHERS == set()


def test_readme_opens_with_the_setup_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = re.match(r"# statechat\n\n```\n(.*?)\n```\n", readme, re.DOTALL)
    assert block, "README.md must open with its set-up commands"
    run, test = block.group(1).splitlines()
    assert run.endswith("pip install torch==2.13.0 -e . && statechat run")
    assert test.endswith("pip install torch==2.13.0 -e '.[dev]' && python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'dev = \[[^]]*"pytest', pyproject)
    assert 'statechat = "statechat.cli:main"' in pyproject
