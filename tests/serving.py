"""Test helpers for servers and tool calling: a tools-rendering template and checkpoint, a
chat server on loopback over a CPU engine, and a POST that returns its answer."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

KEY = "sk-test-key"  # the API key of the test servers

# Qwen3.5's shape for tools, written for the tests of tool calling: the tools as JSON lines in
# a system turn, an assistant's calls as <tool_call> blocks after its text (arguments must be
# a mapping), tool answers in a user turn, a generation prompt that opens <think>
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n"
    "</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- if call.function.arguments is not mapping %}"
    "{{- raise_exception('arguments must be a mapping') }}{%- endif %}"
    "{{- '\\n\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for name, value in call.function.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) }}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city for some days.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
REPLY = "I will look.\n\n" + CALL
TOOLS_ASK = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
             "temperature": 0, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
TOOLS_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]  # (a call made and its tool's answer)


def tools_model(folder: Path, template: str = TOOLS_TEMPLATE):
    """The embedded tiny model copied into `folder` (new) with `template` as its
    chat_template.jinja, loaded in float32 (a LoadedModel)."""
    import shutil

    from statechat.model.loader import load_model
    from statechat.paths import EMBEDDED_MODEL

    shutil.copytree(EMBEDDED_MODEL, folder)
    (folder / "chat_template.jinja").write_text(template)
    return load_model(folder, dtype=torch.float32)


@contextlib.contextmanager
def serving(loaded, **fields):
    """A ChatServer on loopback (port 0, KEY) over a CPU engine of `loaded`, with tools on
    (`--tool-call-parser qwen3_coder`) and no next-turn warm-ups unless `fields` (ChatServer's)
    say otherwise; shut down when the block ends."""
    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=loaded.path, device="cpu", max_model_len=1024),
                       loaded=loaded)
    with serving_engine(engine, **{"warm_next_turn": False, "tool_call_parser": "qwen3_coder",
                                   **fields}) as srv:
        yield srv


@contextlib.contextmanager
def serving_engine(engine, name: str = "tiny", **fields):
    """A ChatServer named `name` on loopback (port 0, KEY) over `engine` in a worker of its
    own, with `fields` (ChatServer's); shut down when the block ends."""
    import threading

    from statechat.engine.worker import EngineWorker
    from statechat.server import ChatServer

    worker = EngineWorker(engine)
    srv = ChatServer(worker, name, "127.0.0.1", 0, api_key=KEY, quiet=True, **fields)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        worker.shutdown()
        thread.join(10)


def post(server, body: dict) -> list[dict] | dict:
    """The JSON answer (an error's too), or a stream's chunks."""
    req = urllib.request.Request(f"{server.url}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read())}
    if not body.get("stream"):
        return json.loads(text)
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def tools_fixtures(**fields):
    """A test module's fixtures `loaded` (tools_model, once a module) and `server` (it served
    by `serving`, with `fields`): `loaded, server = tools_fixtures()` at the module's top
    level."""
    @pytest.fixture(scope="module")
    def loaded(tmp_path_factory):
        return tools_model(tmp_path_factory.mktemp("tools") / "tiny-tools")

    @pytest.fixture(scope="module")
    def server(loaded):
        with serving(loaded, **fields) as srv:
            yield srv

    return loaded, server
