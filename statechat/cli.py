"""The `statechat` command line (Typer): thin commands that build a config and call one function.

Known errors print one line (`statechat: ...`); set STATECHAT_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from statechat.errors import StatechatError

app = typer.Typer(
    help="statechat: chat with Qwen3.5 hybrid models, reusing every prefix it has computed.",
    no_args_is_help=True,
    add_completion=False,
)

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", help="Qwen3.5 checkpoint directory (default: one in the HF cache, "
                 "else the embedded tiny random-weight model).", envvar="STATECHAT_MODEL"),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto | cpu | cuda | npu", envvar="STATECHAT_DEVICE")
]


@app.callback()
def _root() -> None:
    """statechat: chat with Qwen3.5 hybrid models, reusing every prefix it has computed."""


def _engine(model: Path | None, device: str):
    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine
    from statechat.paths import default_model

    return LLMEngine(EngineConfig(model=model or default_model(), device=device))


@app.command()
def run(model: ModelOpt = None, device: DeviceOpt = "auto") -> None:
    """Chat in the terminal. Each turn reports how much of the prompt came from the cache."""
    from statechat.chat.template import render
    from statechat.engine.sampling import SamplingParams
    from statechat.paths import is_embedded

    engine = _engine(model, device)
    if is_embedded(engine.loaded.path):
        typer.secho(
            "Using the embedded tiny Qwen3.5 with RANDOM weights: replies are noise. "
            "Point --model at a real Qwen3.5 checkpoint directory for real answers.",
            fg="yellow", err=True,
        )
    typer.echo("Type a message and press Enter; an empty line or Ctrl-D quits.", err=True)
    messages: list[dict] = []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = render(engine.tokenizer, messages)
        typer.echo("assistant> ", nl=False)
        out = None
        for event in engine.stream(ids, SamplingParams(max_tokens=256)):
            typer.echo(event.text, nl=False)
            out = event.output or out
        typer.echo("")
        if out is not None:
            messages.append({"role": "assistant", "content": out.text})
            typer.secho(
                f"[reused {out.num_cached_tokens:,} of {out.num_prompt_tokens:,} prompt tokens; "
                f"computed {out.num_computed_tokens:,}; {out.num_completion_tokens} new]",
                dim=True, err=True,
            )


def main() -> None:
    """Entry point: run the Typer app, turning known errors into one line."""
    try:
        app(standalone_mode=False)
    except StatechatError as e:
        if os.environ.get("STATECHAT_DEBUG") == "1":
            raise
        typer.secho(f"statechat: {e}", fg="red", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as e:
        # usage errors of Typer's click: they know how to show themselves
        if callable(getattr(e, "show", None)) and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
