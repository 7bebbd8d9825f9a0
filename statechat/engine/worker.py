"""EngineWorker: one thread owns an LLMEngine; other threads submit requests and read events.

    worker = EngineWorker(engine)
    handle = worker.submit(prompt_ids, SamplingParams(max_tokens=64))
    for event in handle:            # StreamEvent(text, token_ids, output); output on the last
        print(event.text, end="")
    worker.shutdown()

LLMEngine is not thread-safe, so only the worker thread touches it after construction. Requests
submitted from several threads join the running batch at the next step (continuous batching).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from statechat.engine.engine import LLMEngine, RequestOutput, StreamEvent
from statechat.engine.sampling import SamplingParams
from statechat.engine.sequence import Sequence
from statechat.errors import ShuttingDownError

log = logging.getLogger("statechat.engine")
_DONE = object()
LONG_TEXT_CHARS = 1 << 16  # a text past this many characters is tokenized in the long lane


class RequestHandle:
    """One submitted request: iterate it for StreamEvents; the last carries the RequestOutput.

    An error inside the engine is raised from the iteration. `abort()` stops the request; its
    stream then ends with finish_reason 'abort'.
    """

    def __init__(self, worker: EngineWorker, prompt_ids: list[int], packed: bytes,
                 params: SamplingParams, request_id: str,
                 on_end: Callable[[RequestOutput | None, float], None] | None = None) -> None:
        self.worker, self.prompt_ids, self.params, self.request_id = (worker, prompt_ids, params,
                                                                      request_id)
        self.packed = packed  # the ids' int32 bytes, from the engine's check
        self.submitted = time.perf_counter()  # (its TTFT counts from here: the worker may be
        # in the middle of a long step when it is submitted)
        self.events: queue.Queue = queue.Queue()
        self.output: RequestOutput | None = None
        self.seq: Sequence | None = None  # set by the worker thread
        self.sent_text = 0
        self.sent_tokens = 0
        self.started = threading.Event()  # set with its first event (its prompt is computed)
        self.speculative = False  # (see EngineWorker.submit)
        self.ended = False  # its end mark was read
        self.error: BaseException | None = None  # the error it ended with, once read
        self.end_time: float | None = None  # (perf_counter) when the worker delivered its end
        self.on_end = on_end  # called with (its output, None if it failed; latency_s) as it ends
        self._last: RequestOutput | BaseException | None = None  # (the worker's: on_end's)

    def put(self, item) -> None:
        """(The worker thread) deliver an event, an error or the end mark; at the end, call
        on_end before the mark is put, so whoever reads the end sees it called."""
        if isinstance(item, BaseException) or getattr(item, "output", None) is not None:
            self._last = item if isinstance(item, BaseException) else item.output
        if item is _DONE:
            self.end_time = time.perf_counter()
            if self.on_end is not None:
                output = None if isinstance(self._last, BaseException) else self._last
                try:
                    self.on_end(output, self.end_time - self.submitted)
                except Exception:  # (logged: the engine thread goes on, and the end is put)
                    log.exception("the end callback of request %r failed", self.request_id)
        self.events.put(item)
        self.started.set()

    @property
    def latency_s(self) -> float | None:
        """Seconds from its submission to its end (None until it has ended)."""
        return None if self.end_time is None else self.end_time - self.submitted

    def __iter__(self) -> Iterator[StreamEvent]:
        yield from self._events()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end and return the final output (or raise the request's error). With
        a timeout, TimeoutError once that many seconds passed first (the request goes on:
        call again, or abort it)."""
        for _ in self._events(timeout):
            pass
        return self.output

    def _events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """The events not read yet, then the end: the request's output kept, or its error
        raised (again on every later call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.error is not None:
                raise self.error
            if self.ended:
                return
            try:
                item = self.events.get(timeout=None if deadline is None
                                       else max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise TimeoutError(f"not finished after {timeout} s") from None
            if item is _DONE:
                self.ended = True
            elif isinstance(item, BaseException):
                self.error = item
            else:
                if item.output is not None:
                    self.output = item.output
                yield item

    def abort(self) -> None:
        """Stop the request (a no-op once its end was read: nothing is left to stop)."""
        if not self.ended:
            self.worker.abort(self)


class EngineWorker:
    """Runs the engine's step loop in a daemon thread; thread-safe submit, abort, shutdown."""

    def __init__(self, engine: LLMEngine, name: str = "statechat-engine") -> None:
        self.engine = engine
        self.tokenizer_lock = threading.Lock()  # guard for render() calls from many threads
        self._long_lock = threading.Lock()  # the long lane's (see tokenizer_for)
        self._long_tokenizer = None  # its copy of the tokenizer, made at its first use
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, RequestHandle] = {}  # seq_id -> handle
        self._stopping = False
        self._submit_lock = threading.Lock()  # no request queued after the stop: none unheard
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- any thread ---------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               template_kwargs: dict | None = None, tools: list[dict] | None = None,
               chat_template: str | None = None) -> list[int]:
        """Token ids of a conversation with the model's chat template (serialized, in the
        lane of its text's length, the tools' and template variables' counted: see
        tokenizer_for); `tools`: the template's, `chat_template`: a request's own template
        (chat/template.render)."""
        from statechat.chat.template import render

        size = _num_chars((messages, tools, template_kwargs, chat_template))
        with self.tokenizer_for(size) as tokenizer:
            return render(tokenizer, messages, add_generation_prompt, template_kwargs, tools,
                          chat_template)

    def warm_structured(self) -> threading.Thread | None:
        """Build the structured outputs' view of the tokenizer (Grammars.warm: about a second
        for 250k tokens) in a thread of its own, holding the tokenizer as a request's check
        does; the thread (None: the engine has no structured outputs)."""
        grammars = getattr(getattr(self.engine, "runner", None), "grammars", None)
        if grammars is None:
            return None

        def warm() -> None:
            with self.tokenizer_lock:
                grammars.warm()

        thread = threading.Thread(target=warm, name="statechat-grammars", daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def tokenizer_for(self, num_chars: int):
        """The tokenizer to encode a text of `num_chars` characters with, held by the caller
        alone meanwhile. A text past LONG_TEXT_CHARS gets a copy of the tokenizer of its own
        under a lock of its own (the long lane): a prompt of megabytes, seconds of encoding,
        holds up the other long ones only, not every request's tokenization. (Encoding
        releases the GIL, so the lanes run side by side.)"""
        if num_chars <= LONG_TEXT_CHARS:
            with self.tokenizer_lock:
                yield self.engine.tokenizer
            return
        with self._long_lock:
            if self._long_tokenizer is None:
                with self.tokenizer_lock:  # (copied while no one uses it)
                    self._long_tokenizer = copy.deepcopy(self.engine.tokenizer)
            yield self._long_tokenizer

    def idle(self) -> bool:
        """Whether no request is queued or running (seen from another thread: the state of a
        moment, which the next submit changes)."""
        return not self._live and self._inbox.empty()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None,
               request_id: str = "",
               checked: tuple[list[int], bytes] | None = None,
               speculative: bool = False,
               on_end: Callable[[RequestOutput | None, float], None] | None = None,
               ) -> RequestHandle:
        """Queue a request; raise ConfigError at once for a prompt the engine cannot run (see
        LLMEngine.check_prompt) or a structured output its tokenizer cannot follow. `checked`:
        what check_prompt already returned for it (a prompt submitted several times is checked
        once). A `speculative` request (work done ahead, such as a next turn's prefix) yields to
        every other: it is aborted as soon as another request is added, so that its prefix is
        not computed twice and it delays the request by its step in flight at most.
        `on_end(output, latency_s)` is called on the worker thread as the request ends (output
        None if it failed), before its end can be read: keep it short.
        No params: the engine's default_params (the checkpoint's recommended sampling), as
        LLMEngine.add_request's."""
        ids, packed = checked or self.engine.check_prompt(prompt_ids)
        ids = list(ids) if checked else ids  # (its sequence appends to it: one list each)
        if params is None:  # (set when the engine was made: read from any thread)
            params = self.engine.default_params
        if params.structured is not None:  # (refused at once, as a bad prompt is)
            with self.tokenizer_lock:
                self.engine.check_structured(params)
        handle = RequestHandle(self, ids, packed, params, request_id, on_end)
        handle.speculative = speculative
        with self._submit_lock:
            if self._stopping:
                raise ShuttingDownError("the engine is shutting down; try again once it is back")
            self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self._inbox.put(("abort", handle))

    def shutdown(self, timeout: float | None = 30.0) -> bool:
        """Abort every live request, close the engine (pending cache writes), stop the thread;
        whether it stopped within `timeout` seconds (None: wait as long as it takes)."""
        with self._submit_lock:
            self._stopping = True
            self._inbox.put(("stop", None))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- the worker thread --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            try:
                cmd = self._inbox.get(block=not busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._abort_all()
                    close = getattr(self.engine, "close", None)  # flush pending cache writes
                    if close is not None:
                        close()
                    return
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                self._step()

    def _handle(self, cmd: tuple) -> None:
        kind, handle = cmd
        if kind == "add":
            try:
                handle.seq = self.engine.add_checked(handle.prompt_ids, handle.packed,
                                                     handle.params, handle.request_id,
                                                     handle.submitted)
            except Exception as e:  # noqa: BLE001 - delivered to the submitter
                handle.put(e)
                handle.put(_DONE)
                return
            handle.seq.speculative = handle.speculative  # (its steps keep to the time target)
            if not handle.speculative:  # (work done ahead yields: see submit)
                for ahead in [h for h in self._live.values() if h.speculative]:
                    self.engine.abort(ahead.seq)
                    self._publish(ahead)
            self._live[handle.seq.seq_id] = handle
        elif kind == "abort" and handle.seq is not None and handle.seq.seq_id in self._live:
            self.engine.abort(handle.seq)
            self._publish(handle)

    def _step(self) -> None:
        try:
            updated = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the live requests, keep serving
            for handle in list(self._live.values()):
                self.engine.abort(handle.seq)
                self._live.pop(handle.seq.seq_id, None)
                handle.put(e)
                handle.put(_DONE)
            return
        for seq in updated:
            handle = self._live.get(seq.seq_id)
            if handle is not None:
                self._publish(handle)

    def _publish(self, handle: RequestHandle) -> None:
        """Send the new text of handle's sequence; on finish, the output and the end mark."""
        seq = handle.seq
        if seq.num_text_tokens <= handle.sent_tokens and not seq.is_finished:
            return
        event, handle.sent_text, handle.sent_tokens = self.engine.next_event(
            seq, handle.sent_text, handle.sent_tokens)
        if event is not None:
            handle.put(event)
        if seq.is_finished:
            self._live.pop(seq.seq_id, None)
            handle.put(_DONE)

    def _abort_all(self) -> None:
        for handle in list(self._live.values()):
            self.engine.abort(handle.seq)
            self._publish(handle)


def _num_chars(value) -> int:
    """The characters of the strings in `value` (messages, tools, template variables: their
    parts' too), to choose a tokenizer's lane by; walked without recursion, as a request's
    values may nest deeper than Python's stack."""
    total, left = 0, [value]
    while left:
        item = left.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            left.extend(item.values())
        elif isinstance(item, list | tuple):
            left.extend(item)
    return total
