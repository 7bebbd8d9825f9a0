"""Sequence: one request's tokens and bookkeeping. Plain Python, no tensors."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from statechat.engine.sampling import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request in flight.

    token_ids holds the prompt then the generated tokens. The model has consumed the first
    `num_computed` of them: their keys/values are in the blocks of `block_table` and the GDN
    state after them is in `slot` (or, before the first step, in `resume_slot`).
    """

    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    slot: int = 0  # working GDN state slot (0 = none yet)
    resume_slot: int = 0  # checkpoint slot the first step reads from (0 = zeros)
    pending_slot: int = 0  # holds the state at the last block boundary of the reply
    pending_tokens: int = 0  # boundary that pending_slot holds
    num_cached_tokens: int = -1  # prompt tokens reused from the cache (-1 = not yet admitted)
    reused_from: str | None = None  # tier of the checkpoint resumed from
    reused_by_tier: dict[str, int] = field(default_factory=dict)  # reused tokens by KV tier
    cache_plan: dict | None = None  # predicted load vs recompute time and the choice
    num_restored: int = 0  # tokens its latest admission took from the cache (not computed)
    num_recomputed: int = 0  # tokens it computed, then gave up when preempted
    num_preemptions: int = 0
    blocks_short: tuple[int, bytes | None] | None = None  # since it last gave way for want of
    # KV blocks (Admission): the spare blocks it waits for, and the hash of the last block its
    # admission restored (None: none, or preempted while it ran)
    speculative: bool = False  # work done ahead (a next turn's prefix): its prefill steps keep
    # to the step time target while nothing else runs, as a step with decodes does (Scheduler)
    steps_overtaken: int = 0  # steps in which later ones were admitted past it while it waited
    # with no chunk (Admission: after MAX_OVERTAKEN it is no longer passed over)
    steps_starved: int = 0  # steps in a row in which, the oldest prompt in flight, its chunk
    # was raised to its reserve (prefill_plan.reserve: it doubles per step)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string matched or stop token id (vLLM's)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per
    # generated token, when params.logprobs is set: its logprob, [(id, logprob)] of the likeliest
    prompt_logprobs: list = field(default_factory=list)  # when params.prompt_logprobs is set:
    # per prompt token, None for the first (and any not computed yet), else (logprob,
    # [(id, logprob)] of the likeliest, rank)
    text: str = ""  # detokenized output so far
    num_text_tokens: int = 0  # output tokens already turned into `text`
    detok_window: list[int] = field(default_factory=list)  # incremental detokenizer: the ids
    # it decodes, a context then tokens held back; detok_offsets: (the context's length, reply
    # tokens looked at, characters of the context's text not shown yet) (output.detokenize)
    detok_offsets: tuple[int, int, int] = (0, 0, 0)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None  # when its latest token was sampled (perf_counter)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        self.request_id = self.request_id or f"req-{self.seq_id}"

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to feed."""
        return (self.num_computed == len(self.token_ids) - 1
                and len(self.token_ids) > self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
