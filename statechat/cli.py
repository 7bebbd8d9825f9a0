"""The `statechat` command line (Typer): thin commands that build a config and call one function.

    statechat run                 the chat app (Textual TUI)
    statechat batch INPUT.jsonl   chat requests in, results out, all batched together
    statechat serve               OpenAI-compatible HTTP API
    statechat cache stats|ls|...  inspect and trim the persistent prefix cache
    statechat chats ls|show|...   list, show, export and delete the app's chats

Known errors print one line (`statechat: ...`); set STATECHAT_DEBUG=1 for the traceback. A
command whose standard output's reader goes away (`| head -1`) ends quietly with exit status
141 (ReaderGone, raised by the command groups of cli_options.py). How `main` ends the process,
from what the app raised, is in cli_exit.py. The
options shared by several commands, and their checks, are in cli_options.py; a command's engine
config and sampling are made from them, and its engine from that config, in cli_setup.py. The
`serve` command is in cli_serve.py, the `cache` commands in cli_cache.py (their store opened
in cli_cache_store.py), the `chats` commands in cli_chats.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from statechat import cli_setup
from statechat.api_reasoning import check_parser
from statechat.api_tools import check_tool_parser
from statechat.cli_batch import (
    STDIN,
    Terminated,
    input_name,
    progress_bar,
    read_requests,
    report_failures,
    results,
    sigterm_interrupts,
    write_records,
    writes_in_place,
)
from statechat.cli_cache import cache_app
from statechat.cli_chats import chats_app
from statechat.cli_exit import end_process, exit_status
from statechat.cli_options import (
    AutoToolChoiceOpt,
    CacheDirOpt,
    ChatTemplateOpt,
    DeviceOpt,
    DiskCacheBytesOpt,
    DtypeOpt,
    FlagsGroup,
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
    SeedOpt,
    TemperatureOpt,
    TemplateKwargsOpt,
    ToolCallParserOpt,
    TopKOpt,
    TopPOpt,
    parse_template_kwargs,
)
from statechat.cli_serve import serve
from statechat.cli_setup import command_setup, warn_if_embedded
from statechat.cli_system_prompt import SystemPromptFileOpt, SystemPromptOpt, system_prompt

app = typer.Typer(
    cls=FlagsGroup,
    help="statechat: chat with Qwen3.5 hybrid models, reusing every prefix it has computed.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(cache_app, name="cache")
app.add_typer(chats_app, name="chats")


def _show_version(value: bool) -> None:
    if value:
        from statechat import __version__

        typer.echo(f"statechat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Show the version and exit.",
                                          callback=_show_version, is_eager=True)] = False,
) -> None:
    """statechat: chat with Qwen3.5 hybrid models, reusing every prefix it has computed."""


# --- run / batch / serve -------------------------------------------------------------------
@app.command(short_help="Chat in the terminal app: branching conversations, each reply "
                         "reporting cache reuse.")
def run(
    ctx: typer.Context,
    model: ModelOpt = None, cache_dir: CacheDirOpt = None, device: DeviceOpt = "auto",
    no_cache: NoCacheOpt = False, chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    system_prompt_text: SystemPromptOpt = None, system_prompt_file: SystemPromptFileOpt = None,
    temperature: TemperatureOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None,
    min_p: MinPOpt = None, presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None, repetition_penalty: RepetitionPenaltyOpt = None,
    max_tokens: MaxTokensOpt = None,
    max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedTokensOpt = None, memory_fraction: MemoryFractionOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    dtype: DtypeOpt = None, disk_cache_bytes: DiskCacheBytesOpt = None,
    max_step_ms: MaxStepMsOpt = None,
) -> None:
    """Chat in the terminal app: branching conversations, each reply reporting cache reuse.
    Sampling: temperature 0.7, top-p 0.95, 1,024 tokens, unless the model's generation config
    or the flags say otherwise."""
    from statechat.paths import cache_dir as resolve_cache_dir
    from statechat.tui import terminal

    with terminal.typeahead():  # (keys typed while torch imports wait for the app: Ctrl+Q)
        from statechat.tui.app import DEFAULT_SAMPLING, StatechatApp

        config, sampling = command_setup(DEFAULT_SAMPLING, locals())
        system = system_prompt(ctx, system_prompt_text, system_prompt_file)
        terminal.require_terminal()  # (before the app loads the model)
        chat_app = StatechatApp(config, chat_dir=resolve_cache_dir(cache_dir), sampling=sampling,
                                template_kwargs=parse_template_kwargs(chat_template_kwargs),
                                system_prompt=system)
        chat_app.run()
    global _app_closed
    _app_closed = chat_app.is_closed  # (the engine stopped in time: its cache writes are done)
    if chat_app.return_code:
        raise typer.Exit(chat_app.return_code)


# `batch`'s own argument and option (the shared ones are in cli_options.py)
BatchInputArg = Annotated[Path, typer.Argument(
    help="JSONL file ('-': standard input), one request a line (or OpenAI's batch format: "
    "{\"custom_id\", \"url\", \"body\"}): {\"id\" (a string or a number), \"messages\", optional "
    "\"max_tokens\" (or \"max_completion_tokens\"), \"temperature\", \"top_p\", \"top_k\", "
    "\"min_p\", \"presence_penalty\", \"frequency_penalty\", \"repetition_penalty\", \"seed\", "
    "\"stop\", \"stop_token_ids\", \"ignore_eos\", \"include_stop_str_in_output\", "
    "\"skip_special_tokens\", \"n\" (samples, 1 to 16: the result's \"choices\"), \"logprobs\" "
    "(a count, or true with \"top_logprobs\"), \"prompt_logprobs\", \"min_tokens\", "
    "\"logit_bias\", \"chat_template_kwargs\", \"include_reasoning\" (with --reasoning-parser), "
    "\"tools\", \"tool_choice\" and \"parallel_tool_calls\" (with --tool-call-parser), a "
    "structured output as serve takes it: \"response_format\", vLLM's \"guided_json\", "
    "\"guided_regex\", "
    "\"guided_choice\", \"guided_grammar\" or \"structured_outputs\", llama.cpp's "
    "\"json_schema\" or \"grammar\"}.")]
BatchOutputOpt = Annotated[Path | None, typer.Option(
    "--output", "-o", help="Where to write the results (JSONL, input order); default (or '-'): "
    "stdout.")]


@app.command(short_help="Run chat requests from a JSONL file together; one JSON result per "
                         "line, in order.")
def batch(
    ctx: typer.Context, input: BatchInputArg, output: BatchOutputOpt = None,
    model: ModelOpt = None, cache_dir: CacheDirOpt = None, device: DeviceOpt = "auto",
    no_cache: NoCacheOpt = False, chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    system_prompt_text: SystemPromptOpt = None, system_prompt_file: SystemPromptFileOpt = None,
    temperature: TemperatureOpt = None, top_p: TopPOpt = None, top_k: TopKOpt = None,
    min_p: MinPOpt = None, presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None, repetition_penalty: RepetitionPenaltyOpt = None,
    max_tokens: MaxTokensOpt = None, seed: SeedOpt = None,
    max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxBatchedTokensOpt = None, memory_fraction: MemoryFractionOpt = None,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    dtype: DtypeOpt = None, disk_cache_bytes: DiskCacheBytesOpt = None,
    max_step_ms: MaxStepMsOpt = None,
    reasoning_parser: ReasoningParserOpt = None,
    tool_call_parser: ToolCallParserOpt = None, enable_auto_tool_choice: AutoToolChoiceOpt = False,
) -> None:
    """Run chat requests from a JSONL file together; write one JSON result per line, in order.
    Sampling: greedy, 256 tokens, unless the model's generation config, the flags or a line's
    own fields say otherwise."""
    from statechat.batch_lines import (
        DEFAULT_SAMPLING,
        BatchDefaults,
        error_record,
        ignored_fields,
        parse_lines,
    )

    output = None if output == STDIN else output
    direct = writes_in_place(output, input)  # (a bad output: one line, first)
    # (a bad flag: one line now, not an error on every line)
    config, sampling = command_setup(DEFAULT_SAMPLING, locals(), seed=seed, min_max_tokens=0)
    check_parser(reasoning_parser)
    check_tool_parser(tool_call_parser, enable_auto_tool_choice)
    defaults = BatchDefaults(sampling, parse_template_kwargs(chat_template_kwargs),
                             tool_call_parser,
                             system_prompt(ctx, system_prompt_text, system_prompt_file))
    # (read last: standard input's producer, or a person typing, is not waited on first)
    jobs = parse_lines(read_requests(input), defaults)
    if (ignored := ignored_fields(jobs)) is not None:
        typer.echo(f"statechat: {ignored}", err=True)
    if not jobs:  # (nothing to run: no model to load)
        typer.echo(f"statechat: {input_name(input)} has no requests", err=True)
    if not jobs or all(job.error is not None for job in jobs):  # (nor when none can run)
        with results(output, direct) as sink:
            records = [error_record(job) for job in jobs]
            write_records(sink, output, records)
        return report_failures(records)
    engine = cli_setup.load_engine(config)  # (by attribute: tests/cli's stand-in reaches it)
    warn_if_embedded(engine.loaded.path)
    records = _run_jobs(engine, jobs, output, direct, reasoning_parser)
    report_failures(records)


def _run_jobs(engine, jobs: list, output: Path | None, direct: bool,
              reasoning_parser: str | None) -> list[dict]:
    """Run `jobs` on `engine`, writing each result as it ends (to `output`, or standard output)
    with a progress bar; return the records. SIGTERM, like Ctrl+C, keeps the finished results;
    the engine is closed (its cache writes flushed) on the way out."""
    from statechat.batch import run_batch

    with contextlib.ExitStack() as stack:  # (exits in reverse: the results in place, then the
        # cache flushed, which may wait long for a lock another process holds on its index)
        # (`| head`: ReaderGone goes through it all, nothing more computed; main ends it)
        stack.enter_context(sigterm_interrupts())  # (SIGTERM keeps the finished results too)
        stack.enter_context(_exit_status_of(Terminated))  # (Typer's is 130, Ctrl+C's)
        stack.callback(getattr(engine, "close", lambda: None))  # flush pending cache writes
        sink = stack.enter_context(results(output, direct))
        progress = stack.enter_context(progress_bar())
        task = progress.add_task("batch", total=None)
        records = run_batch(engine, jobs, lambda rec: write_records(sink, output, [rec]),
                            lambda done, total: progress.update(task, completed=done, total=total),
                            reasoning_parser)
    return records


@contextlib.contextmanager
def _exit_status_of(kind: type[BaseException]):
    """An exception of `kind` (with an `exit_code`) ends the command with its own status."""
    try:
        yield
    except kind as e:
        raise typer.Exit(e.exit_code) from None


app.command(short_help="Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                       "/v1/responses) and Anthropic's /v1/messages.")(serve)


# `run`'s app closed everything it opened (the engine stopped, the cache written, the chats
# closed): the process may then end without the interpreter's teardown, 1-2 s of garbage
# collection over torch's, transformers' and Textual's objects after the screen is gone
_app_closed = False


def main() -> None:
    """Entry point: run the Typer app, turning known errors into one line (cli_exit.py)."""
    global _app_closed
    _app_closed = False  # (set by this call's own `run` alone)
    end_process(exit_status(app), at_once=_app_closed)


if __name__ == "__main__":
    main()
