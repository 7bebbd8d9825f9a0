"""`statechat serve`: the OpenAI-compatible HTTP API (statechat/server.py) over one engine, with
the options that only it takes (--host, --port, --api-key, --allowed-origins,
--served-model-name, --warm-next-turn, --trust-request-chat-template, --reasoning-parser,
--tool-call-parser, --enable-auto-tool-choice). cli.py adds it to the app. Its port
is bound before the model loads; an address it cannot listen on is one line that names the flag
to change."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from statechat import cli_setup
from statechat.api_reasoning import check_parser
from statechat.api_tools import check_tool_parser
from statechat.cli_options import (
    AutoToolChoiceOpt,
    CacheDirOpt,
    ChatTemplateOpt,
    DeviceOpt,
    DiskCacheBytesOpt,
    DtypeOpt,
    FrequencyPenaltyOpt,
    GpuMemoryUtilizationOpt,
    MaxBatchedTokensOpt,
    MaxModelLenOpt,
    MaxNumSeqsOpt,
    MaxStepMsOpt,
    MaxTokensOpt,
    MemoryFractionOpt,
    MinPOpt,
    ModelOpt,
    NoCacheOpt,
    PresencePenaltyOpt,
    ReasoningParserOpt,
    RepetitionPenaltyOpt,
    TemperatureOpt,
    TemplateKwargsOpt,
    ToolCallParserOpt,
    TopKOpt,
    TopPOpt,
    parse_template_kwargs,
)
from statechat.cli_setup import bound_socket, command_setup, listen_errors, warn_if_embedded
from statechat.errors import StatechatError

# `serve`'s own options (the shared ones are in cli_options.py)
HostOpt = Annotated[str, typer.Option(
    help="Address to bind (loopback by default).", envvar="STATECHAT_HOST")]
PortOpt = Annotated[int, typer.Option(
    help="Port to listen on.", envvar="STATECHAT_PORT", min=0, max=65535)]
ApiKeyOpt = Annotated[str | None, typer.Option(
    help="Require 'Authorization: Bearer KEY' on every request.", envvar="STATECHAT_API_KEY")]
AllowedOriginsOpt = Annotated[str | None, typer.Option(
    help="Origins whose web pages may call the API from a browser (CORS): comma-separated or a "
    "JSON list; scheme://host:* for any port, '*' any origin (vLLM's default), '' none. "
    "Default: pages of this machine (localhost, 127.0.0.1, [::1], any port).",
    envvar="STATECHAT_ALLOWED_ORIGINS")]
ServedModelNameOpt = Annotated[str | None, typer.Option(
    help="The model's name in /v1/models and in every response (default: a Hugging Face "
    "snapshot's repo id, else the model folder's name).", envvar="STATECHAT_SERVED_MODEL_NAME")]
TrustRequestTemplateOpt = Annotated[bool, typer.Option(
    "--trust-request-chat-template", help="Render a request's own chat_template (vLLM's flag; "
    "without it such a request is a 400: a template is code, which could hold the server).",
    envvar="STATECHAT_TRUST_REQUEST_CHAT_TEMPLATE")]
WarmNextTurnOpt = Annotated[bool, typer.Option(
    help="While nothing else runs, compute the prefix a sent reply's next turn starts with (a "
    "thinking template drops the reply's reasoning from it, so it is not cached yet).")]


def serve(
    host: HostOpt = "127.0.0.1", port: PortOpt = 8000,
    model: ModelOpt = None, cache_dir: CacheDirOpt = None, device: DeviceOpt = "auto",
    no_cache: NoCacheOpt = False, api_key: ApiKeyOpt = None,
    allowed_origins: AllowedOriginsOpt = None, served_model_name: ServedModelNameOpt = None,
    chat_template: ChatTemplateOpt = None, chat_template_kwargs: TemplateKwargsOpt = None,
    trust_request_chat_template: TrustRequestTemplateOpt = False,
    temperature: TemperatureOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None,
    min_p: MinPOpt = None, presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None, repetition_penalty: RepetitionPenaltyOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedTokensOpt = None, memory_fraction: MemoryFractionOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    dtype: DtypeOpt = None, disk_cache_bytes: DiskCacheBytesOpt = None,
    max_step_ms: MaxStepMsOpt = None, warm_next_turn: WarmNextTurnOpt = True,
    reasoning_parser: ReasoningParserOpt = None,
    tool_call_parser: ToolCallParserOpt = None, enable_auto_tool_choice: AutoToolChoiceOpt = False,
) -> None:
    """Serve an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/responses
    (and GET or DELETE /v1/responses/ID: responses kept in memory), /v1/models, Anthropic's
    /v1/messages and /v1/messages/count_tokens (for Anthropic's SDK), /health,
    /ping, /version, vLLM's /tokenize and /detokenize, and /metrics (Prometheus's text; like
    /health and /ping, served without the API key). Sampling: temperature 1, top-p 1
    (OpenAI's), 2,048 tokens (16 for a text completion; --max-tokens sets both), unless the
    model's generation config, the flags or a request's own fields say otherwise."""
    from statechat import api_serve
    from statechat.api_request import DEFAULT_SAMPLING
    from statechat.engine.worker import EngineWorker
    from statechat.paths import served_name

    template_kwargs = parse_template_kwargs(chat_template_kwargs)
    origins = _origins(allowed_origins)
    check_parser(reasoning_parser)
    check_tool_parser(tool_call_parser, enable_auto_tool_choice)
    if served_model_name is not None and not served_model_name.strip():
        raise StatechatError("--served-model-name must not be empty")
    config, sampling = command_setup(DEFAULT_SAMPLING, locals())
    with contextlib.closing(bound_socket(host, port)) as sock:  # (before the model loads)
        engine = cli_setup.load_engine(config)  # (by attribute: tests/cli's stand-in reaches it)
        warn_if_embedded(engine.loaded.path)
        # (another server may have taken it meanwhile; only that is told as a listen's error)
        with listen_errors(host, port, api_serve.ListenError):
            name = served_model_name or served_name(engine.loaded.path)
            worker = EngineWorker(engine)
            worker.warm_structured()  # (the first structured request then waits for nothing)
            api_serve.serve(worker, name, host, port,
                            api_key, template_kwargs, sampling, completion_max_tokens=max_tokens,
                            warm_next_turn=warm_next_turn, allowed_origins=origins, sock=sock,
                            reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                            trust_request_chat_template=trust_request_chat_template)


def _origins(allowed_origins: str | None):
    """--allowed-origins parsed (None: this machine's pages); a bad value is one line."""
    from statechat.api_cors import LOCAL_ORIGINS, parse_allowed_origins

    try:
        return LOCAL_ORIGINS if allowed_origins is None else parse_allowed_origins(allowed_origins)
    except ValueError as e:
        raise StatechatError(f"--allowed-origins: {e}") from None
