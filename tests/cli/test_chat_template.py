"""`--chat-template` of `run`, `batch` and `serve` (and STATECHAT_CHAT_TEMPLATE): a Jinja file,
or the template's text itself, replaces the model's chat template for every prompt: the app's
renders, a batch's prompts, the server's. A file that is not there, a file that is not UTF-8,
or a template that does not parse, is one line with exit status 2 before any model loads. A
checkpoint without a chat template of its own loads with one given. `--gpu-memory-utilization`
(vLLM's name) is `--memory-fraction`."""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil

import pytest
from typer.testing import CliRunner

from statechat import cli, cli_setup
from statechat.chat.template import render
from statechat.config import EngineConfig
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL

# a template that renders each message as `role: content` lines (no special tokens)
PLAIN = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
USER = [{"role": "user", "content": "Say something about caches."}]


def plain_ids(tokenizer, messages=USER) -> list[int]:
    """The ids PLAIN gives `messages` with the generation prompt."""
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages)
                            + "assistant:")


@pytest.fixture
def started(monkeypatch, shared_engine):
    """What `run` hands its app (config) and the engine `serve` hands its server (neither is
    started)."""
    got = {}

    class App:
        return_code = 0
        is_closed = True

        def __init__(self, config, chat_dir, **kwargs) -> None:
            got["run"] = config

        def run(self) -> None:
            pass

    def serve(worker, *args, sock=None, **kwargs):
        worker.shutdown()
        sock.close()
        got["serve"], got["serve_kwargs"] = worker.engine, kwargs

    got["App"] = importlib.import_module("statechat.tui.app").StatechatApp  # (the real one)
    monkeypatch.setattr("statechat.tui.app.StatechatApp", App)
    monkeypatch.setattr("statechat.tui.terminal.require_terminal", lambda: None)
    monkeypatch.setattr("statechat.api_serve.serve", serve)
    monkeypatch.setenv("STATECHAT_PORT", "0")
    return got


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli.app, [*args, "--model", str(EMBEDDED_MODEL), "--device", "cpu",
                                        "--no-cache"], env=env)


def test_serve_takes_a_file_or_the_text_or_the_variable(tmp_path, started, loaded):
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    for args, env in [(["--chat-template", str(path)], None),
                      (["--chat-template", PLAIN], None),
                      ([], {"STATECHAT_CHAT_TEMPLATE": str(path)})]:
        result = invoke("serve", *args, env=env)
        assert result.exit_code == 0, result.output
        engine = started["serve"]
        assert engine.config.chat_template == PLAIN
        assert render(engine.tokenizer, USER) \
            == plain_ids(engine.tokenizer)
    assert invoke("serve").exit_code == 0
    assert started["serve"].config.chat_template is None  # the model's own, as before
    assert started["serve"].tokenizer.chat_template == loaded.tokenizer.chat_template


def test_serve_trusts_a_request_s_template_only_when_told(started):
    """A request's chat_template is code the server runs: refused unless the flag (or its
    variable) says to render it, as vLLM's --trust-request-chat-template."""
    for args, env, trusted in [([], None, False), (["--trust-request-chat-template"], None, True),
                               ([], {"STATECHAT_TRUST_REQUEST_CHAT_TEMPLATE": "1"}, True)]:
        result = invoke("serve", *args, env=env)
        assert result.exit_code == 0, result.output
        assert started["serve_kwargs"]["trust_request_chat_template"] is trusted


def test_run_s_app_renders_with_the_template(tmp_path, started, loaded):
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    result = invoke("run", "--chat-template", str(path))
    assert result.exit_code == 0, result.output
    config = started["run"]
    assert config.chat_template == PLAIN
    from tests.tui.test_app import wait_ready

    async def check():
        app = started["App"](config, tmp_path / "chats", loaded=loaded)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_ready(pilot, app)
            assert app.worker.render(USER) == plain_ids(loaded.tokenizer)

    asyncio.run(check())
    assert loaded.tokenizer.chat_template != PLAIN  # (the loaded model's own is left as it was)


def test_batch_prompts_are_rendered_with_the_template(tmp_path, shared_engine, loaded):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": USER, "max_tokens": 2}) + "\n")
    result = invoke("batch", str(src), "-o", str(out), "--chat-template", PLAIN)
    assert result.exit_code == 0, result.output
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["usage"]["prompt_tokens"] == len(plain_ids(loaded.tokenizer))


@pytest.mark.parametrize("value, said", [
    ("templates/missing.jinja", ("--chat-template 'templates/missing.jinja': no such file; pass "
                                "a Jinja file or a template's text")),
    ("{% if %}", "--chat-template is not a valid Jinja template (line 1: "),
    ("{{ messages | no_such_filter }}", ("--chat-template is not a valid Jinja template (line 1: "
                                        "No filter named 'no_such_filter'")),
    ("bad.jinja", "--chat-template {tmp}/bad.jinja is not a valid Jinja template (line 2: "),
    ("latin1.jinja", "--chat-template {tmp}/latin1.jinja is not UTF-8 text"),
    ("empty.jinja", ("--chat-template {tmp}/empty.jinja must be the text of a Jinja chat "
                    "template")),
])
@pytest.mark.parametrize("command", ["run", "batch", "serve"])
def test_a_bad_template_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys,
                                                          command, value, said):
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    (tmp_path / "latin1.jinja").write_bytes("{{ 'café' }}".encode("latin-1"))
    (tmp_path / "empty.jinja").write_text("\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("model loaded"))
    monkeypatch.setattr("statechat.tui.terminal.require_terminal", lambda: None)
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": USER}) + "\n")
    argv = [command, *(["in.jsonl"] if command == "batch" else []), "--model",
            str(EMBEDDED_MODEL), "--device", "cpu", "--chat-template",
            str(tmp_path / value) if value.endswith(".jinja") and "/" not in value else value]
    monkeypatch.setattr("sys.argv", ["statechat", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("statechat: " + said.format(tmp=tmp_path)), err


def test_a_checkpoint_without_a_template_loads_with_one_given(tmp_path):
    path = shutil.copytree(EMBEDDED_MODEL, tmp_path / "model")
    (path / "chat_template.jinja").unlink()
    from statechat.errors import ModelError

    with pytest.raises(ModelError, match="has no chat template; give one with --chat-template"):
        load_model(path)
    loaded = load_model(path, chat_template=PLAIN)
    assert render(loaded.tokenizer, USER) \
        == plain_ids(loaded.tokenizer)


def test_an_engine_config_checks_its_template():
    from statechat.errors import ConfigError

    with pytest.raises(ConfigError, match="chat_template is not a valid Jinja template"):
        EngineConfig(model=EMBEDDED_MODEL, chat_template="{% for %}")


def test_gpu_memory_utilization_is_memory_fraction(started, monkeypatch, capsys):
    result = invoke("serve", "--gpu-memory-utilization", "0.5")
    assert result.exit_code == 0, result.output
    assert started["serve"].config.memory_fraction == 0.5
    monkeypatch.setattr("sys.argv", ["statechat", "serve", "--gpu-memory-utilization", "2",
                                     "--model", str(EMBEDDED_MODEL), "--device", "cpu"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("statechat: --gpu-memory-utilization must be in [0.05, 0.98], got 2.0")


def test_serve_help_stays_readable():
    """The engine panel's column of flags stays narrow (vLLM's alias is not listed in it, but
    named in --memory-fraction's help), and no flag's name is cut."""
    result = CliRunner().invoke(cli.app, ["serve", "--help"], terminal_width=100,
                                env={"COLUMNS": "100"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100
    [fraction] = [line for line in lines if "--memory-fraction" in line]
    assert fraction.index("<float>") < 40, fraction  # (as before: the help text gets the room)
    assert "--gpu-memory-utilization" in result.output
    [template] = [line for line in lines if "--chat-template " in line]
    assert "…" not in template and "<path or text>" in template
