"""vLLM's token routes (server.py serves them): POST /tokenize, a text's or a chat's token ids
(the chat rendered as /v1/chat/completions renders it, so its count is that request's
prompt_tokens) with their count and the context's length; POST /detokenize, token ids back to
their text. A client counts a prompt with them before it sends it."""

from __future__ import annotations

from statechat.api_chat import chat_prompt_ids
from statechat.api_request import ApiError, parse_flag, whole_number
from statechat.api_tools import parse_tools


def tokenize(server, body: dict) -> dict:
    """/tokenize's answer to `body` (`prompt`, a string, or `messages` with a chat's fields;
    `add_special_tokens`, `return_token_strs`), under `server`'s (a ChatServer's) template
    variables and tool parser; ApiError(400) naming the field at fault."""
    worker = server.worker
    if "messages" in body:
        ids = chat_prompt_ids(server, body, parse_tools(body, server.tool_call_parser))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (or send messages, a chat's)", "prompt")
        try:
            prompt.encode()
        except UnicodeEncodeError:  # JSON's \ud800 escapes make lone surrogates
            raise ApiError(400, "prompt is not valid Unicode (a lone surrogate)",
                           "prompt") from None
        add_special = parse_flag(body, "add_special_tokens", True)
        with worker.tokenizer_for(len(prompt)) as tokenizer:
            ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    answer = {"count": len(ids), "max_model_len": worker.max_model_len, "tokens": ids,
              "token_strs": None}
    if parse_flag(body, "return_token_strs"):
        with worker.tokenizer_lock:
            answer["token_strs"] = worker.engine.tokenizer.convert_ids_to_tokens(ids)
    return answer


def detokenize(server, body: dict) -> dict:
    """/detokenize's answer to `body` (`tokens`, ids of the model's vocabulary): {"prompt":
    their text}; ApiError(400) naming `tokens` for anything else."""
    worker = server.worker
    raw = body.get("tokens")
    ids = [whole_number(t) for t in raw] if isinstance(raw, list) else [None]
    vocab_size = worker.engine.loaded.config.vocab_size
    if None in ids or not all(0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"tokens must be an array of token ids (0 to {vocab_size - 1})",
                       "tokens")
    with worker.tokenizer_lock:
        return {"prompt": worker.engine.tokenizer.decode(ids)}
