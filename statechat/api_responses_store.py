"""The Responses API's stored responses (`store`, true by default as OpenAI's): each finished
response with the conversation it ends (its input, the inputs before it through its
previous_response_id, and its output, as chat messages) and where its input ends, so that a
request naming it as `previous_response_id` continues that conversation, GET or DELETE
/v1/responses/ID find it, and GET /v1/responses/ID/input_items lists what came before its
output. They live in this process's memory only (a restart forgets them), in an LRU bounded by
count (MAX_RESPONSES) and by the tokens of the conversations they hold (MAX_TOKENS: each
response counts its input and output tokens, and what it echoes: api_responses_http); the
least recently used go first."""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_RESPONSES = 256
MAX_TOKENS = 2_000_000  # the sum of the stored conversations' tokens (about 8 MB of text)


class ResponseStore:
    """Stored responses by id, thread-safe (a server's request threads share it)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_tokens: int = MAX_TOKENS) -> None:
        self.max_responses, self.max_tokens = max_responses, max_tokens
        self._lock = threading.Lock()
        # id -> (response, conversation, its tokens, the number of its messages that are input)
        self._entries: OrderedDict[str, tuple[dict, list[dict], int, int]] = OrderedDict()
        self._tokens = 0

    def put(self, response: dict, messages: list[dict], num_tokens: int,
            num_input: int | None = None) -> None:
        """Keep `response` (its `id` the key) with its conversation `messages` (of
        `num_tokens` tokens; its first `num_input` the input, None: all but the last),
        evicting the least recently used past the bounds."""
        num_input = max(len(messages) - 1, 0) if num_input is None else num_input
        with self._lock:
            self._pop(response["id"])
            self._entries[response["id"]] = (response, messages, num_tokens, num_input)
            self._tokens += num_tokens
            while len(self._entries) > self.max_responses or (
                    self._tokens > self.max_tokens and len(self._entries) > 1):
                self._pop(next(iter(self._entries)))

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        """(response, conversation) stored under `rid` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return None
            self._entries.move_to_end(rid)
            return entry[0], entry[1]

    def input_of(self, rid: str) -> list[dict] | None:
        """The messages that made the response `rid` (its conversation before its output; now
        the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return None
            self._entries.move_to_end(rid)
            return entry[1][:entry[3]]

    def delete(self, rid: str) -> bool:
        """Forget `rid`; whether it was stored."""
        with self._lock:
            return self._pop(rid)

    def __len__(self) -> int:
        return len(self._entries)

    def _pop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._tokens -= entry[2]
        return entry is not None
