"""A command's setup from its flags, before the model loads: the engine config (model, cache dir
and device resolved; a bad value, a wrong --model or a --max-model-len past the model's positions
is one line naming its flag), the sampling its requests start from and `serve`'s socket; the
engine made from that config; and the warning that the embedded random-weight model is in use."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import typer

from statechat.chat.template import read_template
from statechat.cli_options import compose_sampling, parse_size
from statechat.errors import StatechatError

ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "memory_fraction",
                "dtype", "disk_cache_bytes", "max_step_ms", "chat_template")
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "max_tokens")


def engine_config(model: Path | None, cache_dir: Path | None, device: str,
                  no_cache: bool = False, **engine: float | str | None):
    """The engine's config from the shared flags; `engine`: the engine flags, None where not
    given (EngineConfig's default then). A bad value, a wrong --model or a --max-model-len past
    the model's positions is one line (naming its flag) now, before the model loads."""
    from statechat.config import EngineConfig, flags_named
    from statechat.engine.sizing import check_context_limit
    from statechat.model.config import ModelConfig
    from statechat.paths import cache_dir as resolve_cache_dir
    from statechat.paths import default_model

    with flags_named():
        config = EngineConfig(
            model=model or default_model(), device=device, enable_prefix_cache=not no_cache,
            cache_dir=None if no_cache else resolve_cache_dir(cache_dir),
            **{k: v for k, v in engine.items() if v is not None},
        )
        positions = ModelConfig.from_hf(config.model).max_position_embeddings
        if config.max_model_len:
            check_context_limit(config.max_model_len, positions)
    if config.cache_dir is not None:
        check_cache_dir(config.cache_dir)
    return config


def check_cache_dir(path: Path) -> None:
    """A one-line error, before the model loads, for a cache dir that a file stands in the way
    of: the path itself or a folder above it (the engine would load the model, then fail to
    open its index with advice about permissions)."""
    for folder in (path, *path.parents):
        try:
            if not folder.exists():
                continue
            is_dir = folder.is_dir()
        except OSError:  # (a folder above it this user may not search: the engine says so)
            return
        if not is_dir:
            raise StatechatError(f"{folder} is a file; pass a folder as --cache-dir")
        return


def command_setup(defaults, flags: dict, **sampling):
    """A command's engine config and sampling, from `flags` (its arguments by name: its
    `locals()`) over `defaults`; `sampling`: compose_sampling's other arguments. A bad value is
    one line, before the model loads."""
    engine = {name: flags.get(name) for name in ENGINE_FLAGS}
    engine["disk_cache_bytes"] = parse_size(engine["disk_cache_bytes"])
    engine["chat_template"] = read_template(engine["chat_template"])  # (a file's text)
    alias = flags.get("gpu_memory_utilization")  # (vLLM's name of --memory-fraction)
    if alias is not None and engine["memory_fraction"] is None:
        engine["memory_fraction"] = alias
    try:
        config = engine_config(flags["model"], flags["cache_dir"], flags["device"],
                               flags["no_cache"], **engine)
    except StatechatError as e:  # (name the flag as it was typed)
        if alias is None or not str(e).startswith("--memory-fraction "):
            raise
        raise type(e)(str(e).replace("--memory-fraction", "--gpu-memory-utilization", 1)) \
            from None
    return config, compose_sampling(defaults, config.model, **sampling,
                                    **{name: flags[name] for name in SAMPLING_FLAGS})


def load_engine(config):
    """The engine for `config` (the model loads now); a config error is one line naming its
    flag."""
    from statechat.config import flags_named
    from statechat.engine.engine import LLMEngine

    with flags_named():
        return LLMEngine(config)


def bound_socket(host: str, port: int):
    """`serve`'s socket, bound to host:port before the model loads (api_serve.bind); a port in
    use, or an address this machine does not have, is one line (listen_errors)."""
    from statechat import api_serve

    with listen_errors(host, port):
        return api_serve.bind(host, port)


@contextlib.contextmanager
def listen_errors(host: str, port: int, kind: type[OSError] = OSError):
    """An OSError (of `kind`) of binding or listening on host:port as one line that says which
    flag to change."""
    from statechat.server import host_port

    try:
        yield
    except kind as e:  # (the port taken, or an address this machine does not have)
        fix = "pick another --port" if e.errno == errno.EADDRINUSE else "check --host"
        raise StatechatError(f"cannot listen on {host_port(host, port)} ({e.strerror}); "
                             f"{fix}") from None


def warn_if_embedded(model: Path) -> None:
    """A warning on stderr when `model` is the embedded tiny model (random weights)."""
    from statechat.paths import is_embedded

    if is_embedded(model):
        typer.secho("statechat: using the embedded tiny Qwen3.5 with RANDOM weights (replies are "
                    "noise); pass --model DIR with a real Qwen3.5 checkpoint.",
                    fg="yellow", err=True)
