"""Structured outputs: a reply held to a JSON schema, a regular expression, a list of choices or
a grammar (vLLM's structured outputs, llama.cpp's grammars), by masking at each step the tokens
that cannot continue it.

`StructuredOutput` is what a request asks for, checked when made. `Grammars` (one per runner)
keeps a matcher per sequence (llguidance's, over the model's tokenizer), brings it up to the
sequence's reply before each step, and turns the steps' matchers into a mask of the tokens each
row may draw. Once the reply is whole, the mask leaves only the end-of-sequence tokens.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from statechat.errors import ConfigError

log = logging.getLogger("statechat.engine")

KINDS = ("json", "regex", "choice", "grammar")  # what a StructuredOutput may hold, one of them
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"  # between a JSON schema's tokens (see _spec)
MASK_THREADS = 4  # at most: the threads that compute a step's masks (Grammars._compute)


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a reply (exactly one of the fields but `after_token`):

    - json: a JSON schema (a dict, or its JSON text); True for any JSON object (OpenAI's
      `json_object`). Between its tokens at most a space or a line break and an indent, unless
      the schema's "x-guidance" key sets llguidance's JSON options (`{"whitespace_flexible":
      false}`: none at all);
    - regex: a regular expression the whole reply matches (Rust's regex syntax);
    - choice: the reply is one of these strings;
    - grammar: a context-free grammar, in llama.cpp's GBNF (`root ::= ...`) or Lark.

    `after_token`: the constraint starts after the reply's first such token (a reasoning model's
    end of thinking); None: from the reply's first token. The grammar is checked when made: a
    bad one is a ConfigError that names what is wrong."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after_token: int | None = None
    spec: str = field(init=False, repr=False, compare=False)  # llguidance's grammar text

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ConfigError("a structured output takes exactly one of json, regex, choice and "
                              f"grammar, got {', '.join(given) or 'none'}")
        if self.after_token is not None and (not isinstance(self.after_token, int)
                                             or self.after_token < 0):
            raise ConfigError(f"after_token must be a token id, got {self.after_token!r}")
        try:
            object.__setattr__(self, "spec", _spec(self))
            problem = _llguidance().LLMatcher.validate_grammar(self.spec, None)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (llguidance's converters raise bare Exception too)
            problem = str(e)
        if problem:
            raise ConfigError(f"the {given[0]} of the structured output is not valid: "
                              f"{_one_line(problem)}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _spec(s: StructuredOutput) -> str:
    """llguidance's grammar text for `s` (its fields' types checked)."""
    ll = _llguidance()
    if s.json is not None:
        if s.json is True:
            schema = {"type": "object"}
        elif isinstance(s.json, str):
            try:
                schema = json.loads(s.json)
            except ValueError as e:
                raise ConfigError(f"the JSON schema of the structured output is not JSON: {e}")
        else:
            schema = s.json
        if not isinstance(schema, dict):
            raise ConfigError("a JSON schema must be an object (a dict), got "
                              f"{type(schema).__name__}")
        if s.json is not True:  # (kept as text: the params stay hashable)
            object.__setattr__(s, "json", json.dumps(schema, sort_keys=True))
        # whitespace between JSON's tokens: none, a space, or a line break and an indent of up
        # to 20 (llama.cpp's bound), unless the schema's "x-guidance" says otherwise; free
        # whitespace lets a model that likes blanks write them until max_tokens
        bound = None if "x-guidance" in schema else {"whitespace_pattern": JSON_WHITESPACE}
        return ll.LLMatcher.grammar_from_json_schema(schema, defaults=bound)
    if s.choice is not None:
        choice = list(s.choice) if isinstance(s.choice, list | tuple) else None
        if not choice or not all(isinstance(c, str) and c for c in choice):
            raise ConfigError("choice must be a list of non-empty strings")
        object.__setattr__(s, "choice", tuple(choice))
        return ll.grammar_from("choice", json.dumps(choice))
    name, text = ("regex", s.regex) if s.regex is not None else ("grammar", s.grammar)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{name} must be a non-empty string")
    return ll.grammar_from("regex" if name == "regex" else "grammar", text)


def _one_line(text: str) -> str:
    """An llguidance error (several lines, with a caret under the place) as one line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip().strip("^")]
    return "; ".join(lines)[:300]


def _llguidance():
    import llguidance
    import llguidance.hf  # (from_tokenizer)

    return llguidance


class _Matcher:
    """A sequence's matcher and how much of its reply it has taken."""

    def __init__(self, matcher, after_token: int | None) -> None:
        self.matcher = matcher
        self.taken = 0  # reply tokens looked at
        self.open = after_token is None  # whether the constraint has started
        self.after_token = after_token


class Grammars:
    """The runner's matchers, one per sequence with a structured output; the tokenizer's view
    that they share is built at the first such request (a model's whole vocabulary: about a
    second for 250k tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._ll_tokenizer = None
        self._threads = None  # (llguidance's threads for the masks of several rows)
        self._matchers: dict[int, _Matcher] = {}
        self._fitting: set[str] = set()  # specs `check` passed (the server's thread and the
        # worker's check a request's: once is enough)

    def warm(self) -> None:
        """Build the tokenizer's view now (a server does at its start, off its threads that
        answer, holding the tokenizer: the first structured request then waits for nothing).
        A failure is one line in the log (the first structured request tries again)."""
        try:
            self._tokenizer()
        except Exception as e:  # noqa: BLE001 - no request asked for it yet
            log.warning("statechat: the structured outputs' view of the tokenizer was not "
                        "built (%s)", _one_line(str(e)) or type(e).__name__)

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            self._ll_tokenizer = _llguidance().hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids))
        return self._ll_tokenizer

    def check(self, s: StructuredOutput) -> None:
        """Refuse (ConfigError) a constraint that this model's tokenizer cannot follow (a
        special token it lacks, a token id past its vocabulary), which StructuredOutput could
        not see: its matcher would fail at once and the reply end empty."""
        if s.spec in self._fitting:
            return
        problem = _llguidance().LLMatcher.validate_grammar(s.spec, self._tokenizer())
        if problem:
            raise ConfigError(f"the {s.kind} of the structured output does not fit this "
                              f"model's tokenizer: {_one_line(problem)}")
        if len(self._fitting) >= 256:  # (a bound: specs checked are kept to check once)
            self._fitting.clear()
        self._fitting.add(s.spec)

    def _matcher(self, seq) -> _Matcher:
        m = self._matchers.get(seq.seq_id)
        if m is None:
            s = seq.params.structured
            m = self._matchers[seq.seq_id] = _Matcher(
                _llguidance().LLMatcher(self._tokenizer(), s.spec, log_level=0), s.after_token)
        return m

    def mask(self, seqs: list, width: int, device: torch.device) -> torch.Tensor:
        """[len(seqs), width] bool on `device`: True where the row of seqs[i] may draw the token
        (its logits `width` wide). Each matcher first takes the reply tokens it has not seen;
        the rows' masks are then computed side by side (`_compute`)."""
        import llguidance.torch as llt

        bits = llt.allocate_token_bitmask(len(seqs), self.vocab_size)
        rows, ends = [], []
        for i, seq in enumerate(seqs):
            try:
                m = self._open_matcher(seq)
            except Exception as e:  # noqa: BLE001 - its own reply ends, not the step's others
                self._failed(seq, e)
                ends.append(i)
                continue
            if m is None:
                bits[i].fill_(-1)  # (every token: finished, or its constraint not started)
            else:
                rows.append((i, seq, m.matcher))
        ends += self._compute(rows, bits)
        for i in ends:
            bits[i].zero_()
            for t in self.eos_ids:
                if t < self.vocab_size:
                    bits[i, t // 32] |= _bit(t % 32)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        unpacked = (bits.to(device, non_blocking=True).unsqueeze(-1) >> shifts) & 1
        allowed = unpacked.view(len(seqs), -1)[:, :width].bool()
        if allowed.shape[1] < width:  # (logits wider than the tokenizer's vocabulary)
            pad = allowed.new_zeros(len(seqs), width - allowed.shape[1])
            allowed = torch.cat([allowed, pad], dim=1)
        return allowed

    def _open_matcher(self, seq):
        """The matcher of `seq` caught up with its reply, or None where no token is held (a
        finished row of a step queued ahead, whose draw is dropped; a constraint that starts
        after a token not drawn yet)."""
        if seq.is_finished:
            return None
        m = self._catch_up(seq)
        return m if m.open else None

    def _compute(self, rows: list, bits: torch.Tensor) -> list[int]:
        """Fill the rows of `bits` for `rows` ((i, seq, matcher)): several on llguidance's
        threads at once (32 rows' masks over a 248k-token vocabulary took 0.2 ms one by one and
        0.07 ms so on an H100's host; a counted repetition's, 176 ms and 64 ms), one alone here.
        The indices of those that may only end (their grammar cannot go on, or failed); a
        failure of the batch's computation is retried row by row, so that it ends only the
        rows that fail."""
        import llguidance.torch as llt

        if len(rows) > 1:
            try:
                llt.fill_next_token_bitmask_par(self._executor(),
                                                [(m, i) for i, _, m in rows], bits)
                return _stuck(rows, bits)
            except Exception:  # (retried one by one below)
                log.debug("statechat: the masks of %d rows failed together", len(rows),
                          exc_info=True)
        failed, filled = [], []
        for i, seq, m in rows:
            try:
                llt.fill_next_token_bitmask(m, bits, i)
                filled.append((i, seq, m))
            except Exception as e:  # noqa: BLE001 - its own reply ends, not the others
                self._failed(seq, e)
                failed.append(i)
        return failed + _stuck(filled, bits)

    def _executor(self):
        if self._threads is None:
            self._threads = _llguidance().LLExecutor(min(os.cpu_count() or 1, MASK_THREADS))
        return self._threads

    @staticmethod
    def _failed(seq, e: Exception) -> None:
        log.warning("statechat: the structured output of request %s failed (%s); its reply "
                    "may only end now", seq.request_id, _one_line(str(e)))

    def _catch_up(self, seq) -> _Matcher:
        """The sequence's matcher, having taken every reply token it had not (a step's tokens
        are appended to the sequence after the step is read, before the next one samples)."""
        m = self._matcher(seq)
        start = seq.num_prompt_tokens + m.taken
        for t in seq.token_ids[start:]:
            m.taken += 1
            if not m.open:
                m.open = t == m.after_token
            elif not m.matcher.is_stopped() and not m.matcher.consume_token(t):
                log.warning("statechat: request %s drew token %d that its structured output "
                            "does not allow (%s); it may only end now", seq.request_id, t,
                            _one_line(m.matcher.get_error()))
        return m

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)


def _stuck(rows: list, bits: torch.Tensor) -> list[int]:
    """The indices of `rows` ((i, seq, matcher), their masks filled in `bits`) whose grammar
    cannot go on: a matcher in error, or a mask that allows no token (one pass over `bits`,
    read as 64-bit words where it can be: 0.05 ms for 32 rows of 248k tokens on a CPU where
    one `any` a row took 0.2 ms)."""
    if not rows:
        return []
    words = bits.view(torch.int64) if bits.shape[1] % 2 == 0 else bits
    allows = words.ne(0).any(dim=1).tolist()
    return [i for i, _, m in rows if m.is_error() or not allows[i]]


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch's int32 holds."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
