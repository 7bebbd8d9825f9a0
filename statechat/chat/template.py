"""Render a conversation branch to token ids with the model's chat template, or with one that
replaces it (`--chat-template`, a request's `chat_template`: checked here before any use)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from statechat.errors import ConfigError, first_line

ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"  # (a tool's answer: the server's, with tools on)
TURN_START = "<|im_start|>"  # (ChatML, Qwen's: where a turn of the prompt begins)


def validate_messages(messages: list[dict]) -> None:
    """Raise a one-line ConfigError for a malformed message list (a `tool` message, or an
    assistant's `tool_calls`, are the server's to check: api_messages.py)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in (*ROLES, TOOL_ROLE)
            or not isinstance(m.get("content"), str)
        ):
            raise ConfigError(
                f"message {i} must be {{'role': one of {'/'.join(ROLES)}, 'content': a string}}"
            )
        try:
            m["content"].encode()
        except UnicodeEncodeError:  # (a lone surrogate, as JSON's \ud800 makes one)
            raise ConfigError(f"message {i}'s content is not valid Unicode") from None


def check_template_kwargs(tokenizer, kwargs) -> dict:
    """Extra variables for the chat template (Qwen's `enable_thinking`, say), as given to
    transformers' apply_chat_template; a one-line ConfigError for a malformed dict or for a
    name that apply_chat_template or its renderer takes itself (`tokenize`, `conversations`)."""
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError("chat_template_kwargs must be an object of template variables")
    if tokenizer is None:  # (checked before a model loads: the base class's parameters)
        from transformers import PreTrainedTokenizerBase as tokenizer
    cls = tokenizer if isinstance(tokenizer, type) else type(tokenizer)
    taken = sorted(_reserved(cls) & kwargs.keys())
    if taken:
        raise ConfigError(f"chat_template_kwargs may not set {', '.join(taken)}")
    return kwargs


@functools.lru_cache(maxsize=8)
def _reserved(cls: type) -> frozenset[str]:
    """The names apply_chat_template of tokenizer class `cls` and its renderer take themselves
    (asked once per class: a batch checks every line)."""
    own = inspect.signature(cls.apply_chat_template).parameters
    names = {n for n, p in own.items() if p.kind is not p.VAR_KEYWORD}
    return frozenset(names | {"self", "messages", "conversations"})  # (the renderer's own)


def merge_template_kwargs(defaults: dict | None, own) -> dict | None:
    """A request's template variables over the defaults (the command line's). `own` may be
    anything a client sent: what is not an object goes on as it is, for render to refuse."""
    if not isinstance(own, dict):
        return own if own is not None else (defaults or None)
    return {**(defaults or {}), **own}


def opens_thinking(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a prompt ends inside an opened `<think>`: the reply then begins with reasoning,
    with no tag of its own before it. Qwen3.5's generation prompt ends in one; so does a
    continued assistant message (continue_final_message) whose last turn, from its
    `<|im_start|>`, opens `<think>` after any `</think>` (a reasoning prefill, or a reply cut
    inside its reasoning sent back). A tag in an earlier turn (a user's text) does not count."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    if tail.rstrip().endswith("<think>"):
        return True
    start = tokenizer.convert_tokens_to_ids(TURN_START)
    if not isinstance(start, int) or start == tokenizer.unk_token_id:
        return False
    turn = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] == start), None)
    if turn is None:
        return False
    text = tokenizer.decode(prompt_ids[turn:], skip_special_tokens=False)
    return text.rfind("<think>") > text.rfind("</think>")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
           template_kwargs: dict | None = None, tools: list[dict] | None = None,
           chat_template: str | None = None) -> list[int]:
    """Token ids of `messages`, ending with the assistant header when add_generation_prompt.

    A last message from the assistant with add_generation_prompt=False is continued
    (its end-of-turn marker is left off), so a reply can be extended. template_kwargs: extra
    variables of the template (see check_template_kwargs). tools: OpenAI's function tools, for
    the template's `tools` (as apply_chat_template gives them; None: none). chat_template: a
    template's text (checked: check_template) used instead of the tokenizer's (None: its own).
    """
    validate_messages(messages)
    extra = check_template_kwargs(tokenizer, template_kwargs) if template_kwargs is not None else {}
    continue_last = not add_generation_prompt and messages[-1]["role"] == "assistant"
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_last,
            tokenize=True,
            return_dict=False,
            **({"tools": tools} if tools is not None else {}),
            **({"chat_template": chat_template} if chat_template is not None else {}),
            **extra,
        )
    except Exception as e:  # noqa: BLE001 - the model's own template raised (jinja's errors, ...)
        first = first_line(e)
        raise ConfigError(f"the chat template failed on these messages ({first})") from None
    return list(ids)


def check_template(text, name: str = "chat_template") -> str:
    """`text` if it is a Jinja chat template that compiles as transformers compiles one (its
    filters, `{% break %}`, `{% generation %}`); else a one-line ConfigError that starts with
    `name` (the field or flag that gave it) and gives the line at fault."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{name} must be the text of a Jinja chat template")
    import jinja2

    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:  # (its TemplateAssertionError too: a filter unknown)
        raise ConfigError(f"{name} is not a valid Jinja template (line {e.lineno}: "
                          f"{e.message})") from None
    return text


def _compile(text: str) -> None:
    try:  # (transformers' own environment, cached: the template is compiled once for its use)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # (a transformers that moved it: jinja's parser, its extension added)
        import jinja2
        import jinja2.ext

        jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(text)
        return
    _compile_jinja_template(text)


def read_template(value: str | None, flag: str = "--chat-template") -> str | None:
    """`flag`'s value as a template's text, as vLLM takes it: a file's text, else (no such file,
    and the value has `{{` or `{%`) the value itself; None where not given. A missing or
    unreadable file, one not UTF-8, or a template that does not compile, is one line."""
    if value is None:
        return None
    path = _file(value)
    if path is not None:
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{flag} {path} is not UTF-8 text; save the template as "
                              "UTF-8") from None
        return check_template(text, f"{flag} {path}")
    if "{{" in value or "{%" in value:
        return check_template(value, flag)
    raise ConfigError(f"{flag} {value!r:.80}: no such file; pass a Jinja file or a template's "
                      "text (with {{ or {%)")


def _file(value: str) -> Path | None:
    """The file `value` names, or None where it names none (a template's text: too long a
    name, a NUL, a `~` of no user, a folder; none of which is a file)."""
    try:
        path = Path(value).expanduser()
        return path if path.is_file() else None
    except (OSError, ValueError, RuntimeError):
        return None

