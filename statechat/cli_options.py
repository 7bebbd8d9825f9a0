"""The command line's shared options, each defined once as an `Annotated` alias, the checks
that turn their values into configs before a model loads (a bad value is one line), and the
command groups' class (FlagsGroup: how --help shows a flag, and a broken pipe as ReaderGone)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperGroup

from statechat.errors import ConfigError, ReaderGone, StatechatError

if TYPE_CHECKING:  # (torch loads with it: the commands import it when they run)
    from statechat.engine.sampling import SamplingParams


class FlagsGroup(TyperGroup):
    """A command group whose --help shows no value beside a flag, for its own options and its
    commands' (typer's rich help writes `<bool>` there, as though a flag took one: `--no-cache
    true`); the options that take a value keep theirs. A broken pipe (standard output's reader
    gone) while it parses, shows its help or runs a command is ReaderGone, which cli.main ends
    quietly with exit status 141 (Typer's own handling of one says nothing and exits with 1)."""

    def make_context(self, *args, **kwargs):
        with broken_pipe_as_reader_gone():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with broken_pipe_as_reader_gone():
            return super().invoke(ctx)

    def get_params(self, ctx):
        return _flags_without_value(super().get_params(ctx))

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None:  # (a group of commands does this itself)
            _flags_without_value(command.get_params(ctx))
        return command


@contextlib.contextmanager
def broken_pipe_as_reader_gone():
    """A broken pipe inside `with` (Rich's too: the help) raised as ReaderGone."""
    try:
        with rich_pipe_errors_raised():
            yield
    except BrokenPipeError:
        raise ReaderGone() from None


@contextlib.contextmanager
def rich_pipe_errors_raised():
    """Within `with`, a Rich console (Typer writes the help with one) that finds its reader gone
    raises BrokenPipeError, as a plain write does, rather than ending the process itself with
    exit status 1 (`Console.on_broken_pipe`, which Rich lets a subclass change: Typer makes its
    consoles itself, so the class's is swapped here, and put back after)."""
    try:
        from rich.console import Console
    except ImportError:  # (Typer without Rich: click writes the help, with plain writes)
        yield
        return
    own = Console.on_broken_pipe
    Console.on_broken_pipe = _raise_broken_pipe
    try:
        yield
    finally:
        Console.on_broken_pipe = own


def _raise_broken_pipe(console) -> None:
    console.quiet = True  # (nothing more to a reader that went away)
    raise BrokenPipeError()


def _flags_without_value(params: list) -> list:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # (what the help shows beside it)
    return params


def _path(flag: str, what: str):
    """The parser of a path flag: an empty value (`--cache-dir "$DIR"` with DIR unset) is one
    line naming the flag, not the current folder that Path("") names. An empty variable
    (STATECHAT_CACHE_DIR=) never comes here: click reads it as unset."""
    def parse(value: str | Path) -> Path:
        if isinstance(value, Path):  # (a default, already a path)
            return value
        if not value.strip():
            raise ConfigError(f"{flag} is empty; {what}")
        return Path(value)

    return parse


ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", parser=_path("--model", "pass a Qwen3.5 checkpoint directory, or "
                                         "leave it out for the default"), metavar="<path>",
                 help="Qwen3.5 checkpoint directory (default: one in the HF cache, "
                 "else the embedded tiny random-weight model).", envvar="STATECHAT_MODEL"),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto | cpu | cuda | npu", envvar="STATECHAT_DEVICE")
]
CacheDirOpt = Annotated[
    Path | None,
    typer.Option("--cache-dir", parser=_path("--cache-dir", "pass a folder, or leave it out "
                                             "for the default"), metavar="<path>",
                 help="Cache and conversation directory (default: "
                 "$STATECHAT_CACHE_DIR, else $XDG_DATA_HOME/statechat, "
                 "~/.local/share/statechat when that is unset).",
                 envvar="STATECHAT_CACHE_DIR"),
]
NoCacheOpt = Annotated[
    bool,
    typer.Option("--no-cache", help="Turn the prefix cache off: compute every prompt in full."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
TemplateKwargsOpt = Annotated[
    str | None,
    typer.Option("--chat-template-kwargs", help="Variables for the model's chat template, as a "
                 "JSON object, e.g. '{\"enable_thinking\": false}' (a batch line's or a "
                 "request's own chat_template_kwargs win).",
                 envvar="STATECHAT_CHAT_TEMPLATE_KWARGS"),
]
ChatTemplateOpt = Annotated[
    str | None,
    typer.Option("--chat-template", metavar="<path or text>", help="A chat template that "
                 "replaces the model's for every prompt: a Jinja file, or the template's text "
                 "itself (with {{ or {%), as vLLM's --chat-template.",
                 envvar="STATECHAT_CHAT_TEMPLATE"),
]
ReasoningParserOpt = Annotated[
    str | None,
    typer.Option("--reasoning-parser", help="Split a thinking model's replies into reasoning "
                 "and answer, as vLLM's parser of that name: qwen3 (Qwen3.5's <think>...</think>). "
                 "Default: off, the reply's text whole.", envvar="STATECHAT_REASONING_PARSER"),
]
ToolCallParserOpt = Annotated[
    str | None,
    typer.Option("--tool-call-parser", help="Take requests' tools and tool calls, and parse the "
                 "replies' calls into tool_calls, as vLLM's parser of that name: qwen3_coder "
                 "(Qwen3.5's <tool_call><function=...>). Default: off, tools are refused.",
                 envvar="STATECHAT_TOOL_CALL_PARSER"),
]
AutoToolChoiceOpt = Annotated[
    bool,
    typer.Option("--enable-auto-tool-choice", help="Taken for vLLM's command lines: tool_choice "
                 "auto is on with --tool-call-parser alone."),
]

# Engine: how much the engine holds and computes at once (EngineConfig; None = its default).
ENGINE = "Engine (sizes and memory)"
MaxModelLenOpt = Annotated[int | None, typer.Option(
    "--max-model-len", help="Context limit in tokens, prompt and reply (default: the model's, "
    "or what the KV cache holds if less).", rich_help_panel=ENGINE)]
MaxNumSeqsOpt = Annotated[int | None, typer.Option(
    "--max-num-seqs", help="Requests running at once (default 64).", rich_help_panel=ENGINE)]
MaxBatchedTokensOpt = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", help="Tokens one step computes, prefill chunks and decodes "
    "together (default 4,096).", rich_help_panel=ENGINE)]
MaxStepMsOpt = Annotated[float | None, typer.Option(
    "--max-step-ms", help="While replies stream, a long prompt's prefill is cut into chunks "
    "that keep each step under this many milliseconds, at the measured prefill rate (default: "
    "200 on the CPU; off, 0, on accelerators).", rich_help_panel=ENGINE)]
MemoryFractionOpt = Annotated[float | None, typer.Option(
    "--memory-fraction", help="Share of the accelerator's free memory the KV and GDN state "
    "caches take, in [0.05, 0.98] (default 0.85; on the CPU they take 1 GiB). vLLM's "
    "--gpu-memory-utilization is taken for it.", rich_help_panel=ENGINE)]
# (vLLM's name of --memory-fraction: hidden, so that the help's column of flags stays narrow)
GpuMemoryUtilizationOpt = Annotated[float | None, typer.Option(
    "--gpu-memory-utilization", hidden=True)]
DiskCacheBytesOpt = Annotated[str | None, typer.Option(
    "--disk-cache-bytes", help="Most the disk cache (--cache-dir) keeps, in bytes or with a "
    "unit: 500M, 20G, 1T; least recently used entries go first (default: 10% of the free space "
    "and of the cache's own). Recorded in the cache's index: `cache stats` shows it and `cache "
    "gc` keeps to it.", rich_help_panel=ENGINE)]
DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="auto | float32 | bfloat16 | float16 (default auto, as vLLM's: bfloat16 on "
    "accelerators, float32 on the CPU).", rich_help_panel=ENGINE)]

# Sampling: defaults of every request of a run, over the model's recommended sampling (its
# generation_config.json) and under a request's (or batch line's) own fields; None = not given.
SAMPLING = "Sampling (every request's default; a request's own fields win)"
TemperatureOpt = Annotated[float | None, typer.Option(
    help="Temperature (0 = greedy).", rich_help_panel=SAMPLING)]
TopPOpt = Annotated[float | None, typer.Option(
    help="Keep the likeliest tokens whose probabilities reach this, in (0, 1].",
    rich_help_panel=SAMPLING)]
TopKOpt = Annotated[int | None, typer.Option(
    help="Keep the k likeliest tokens (0 or -1 = off).", rich_help_panel=SAMPLING)]
MinPOpt = Annotated[float | None, typer.Option(
    help="Drop tokens less likely than this times the likeliest, in [0, 1] (0 = off).",
    rich_help_panel=SAMPLING)]
PresencePenaltyOpt = Annotated[float | None, typer.Option(
    help="Subtracted from the logit of every token already generated, in [-2, 2].",
    rich_help_panel=SAMPLING)]
FrequencyPenaltyOpt = Annotated[float | None, typer.Option(
    help="Subtracted from a token's logit once per time it was generated, in [-2, 2].",
    rich_help_panel=SAMPLING)]
RepetitionPenaltyOpt = Annotated[float | None, typer.Option(
    help="Divides the logits of tokens of the prompt and the reply, > 0 (1 = off; above 1 "
    "discourages repeats).", rich_help_panel=SAMPLING)]
MaxTokensOpt = Annotated[int | None, typer.Option(
    help="Most new tokens of a reply.", rich_help_panel=SAMPLING)]
SeedOpt = Annotated[int | None, typer.Option(
    help="Seed of the run: a request without its own seed draws one made from this and its "
    "line number (the same input and seed give the same outputs; identical lines still "
    "differ).", rich_help_panel=SAMPLING)]


def compose_sampling(base: SamplingParams, model: Path, min_max_tokens: int = 1,
                     **flags) -> SamplingParams:
    """The sampling of every request of a command: its own `base` < the model's recommended
    sampling (generation_config.json, as vLLM's --generation-config auto) < the flags given
    (None = not given); a request's own fields win over it later. A bad flag, or a wrong
    --model, is one line now, before the model loads. min_max_tokens: the least --max-tokens
    the command takes (batch's 0 scores each prompt alone, as a line's "max_tokens": 0 does)."""
    from statechat.model.config import ModelConfig

    recommended = dict(ModelConfig.from_hf(model).sampling_defaults)
    given = {key: value for key, value in flags.items() if value is not None}
    if given.get("max_tokens", min_max_tokens) < min_max_tokens:
        raise ConfigError(f"--max-tokens must be >= {min_max_tokens}, got {given['max_tokens']}")
    try:
        sampling = dataclasses.replace(base, **{**recommended, **given})
    except ConfigError as e:  # (its message starts with the field's name: name the flag)
        name, _, rest = str(e).partition(" ")
        raise ConfigError(f"--{name.replace('_', '-')} {rest}") from None
    used = [f"{key} {value:g}" for key, value in recommended.items() if key not in given]
    if used:
        typer.echo(f"statechat: sampling with {', '.join(used)} by default, as the model's "
                   "generation_config.json recommends", err=True)
    return sampling


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = 2**63 - 1  # (SQLite's largest integer, and os's file sizes')


def parse_size(text: str | None, flag: str = "--disk-cache-bytes") -> int | None:
    """A size flag's value (`flag`'s): a byte count, or a number with a unit of SIZE_UNITS
    (powers of 1024; `20G`, `1.5T`, `500MB`, `64KiB`); None where not given. One line for
    anything else, and one that names the limit for a size past MAX_SIZE."""
    from decimal import Decimal, InvalidOperation

    if text is None:
        return None
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in SIZE_UNITS else ""
    try:  # (exact: a byte count up to MAX_SIZE itself is taken as it is)
        number = Decimal(value[:len(value) - len(unit)])
    except InvalidOperation:
        number = Decimal(-1)
    if (not number.is_finite() or number < 0
            or not unit and number != number.to_integral_value()):
        raise StatechatError(f"{flag} must be a size such as 500M, 20G or a byte count, got "
                             f"{text!r:.40}")
    if number > Decimal(MAX_SIZE) / SIZE_UNITS[unit]:
        raise StatechatError(f"{flag} is too large: it takes at most 2**63 - 1 bytes (8 EiB), "
                             f"got {text!r:.40}")
    return int(number * SIZE_UNITS[unit])


def parse_template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs as a dict, checked before the model loads (one line if bad)."""
    from statechat.chat.template import check_template_kwargs

    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise StatechatError("--chat-template-kwargs (or STATECHAT_CHAT_TEMPLATE_KWARGS) must be a "
                             "JSON object, e.g. '{\"enable_thinking\": false}'")
    try:
        return check_template_kwargs(None, value)
    except StatechatError as e:  # (it names a request's field: name the flag)
        raise StatechatError(f"--chat-template-kwargs {str(e).partition(' ')[2]}") from None
