"""n samples of one prompt (SamplingParams.n, vLLM's): the params of each sample's engine
request, and their outputs gathered as one RequestOutput.

Sample i samples with seed + i (vLLM's rule; past 2**64 - 1 it wraps to 0): a seeded request is
reproducible, its samples differ, and its sample 0 is the reply the same request with n = 1
gets. Only sample 0 asks for the prompt's logprobs (a sequence that asks computes its whole
prompt); the others are given its. The samples are queued together, sample 0 first: the others,
forks of its prompt, wait at admission while it computes the checkpoint at its prompt's last
block boundary (prefill_plan.awaits_prefix), then resume there from the prefix cache, so the
prompt is computed once and each sample reports what it reused (with the prefix cache off they
all run at once, each computing the prompt, and report that). LLMEngine's `generate` and
`stream` (requests.py) and the server's choices (api_choices.py) make their samples here.
"""

from __future__ import annotations

import dataclasses

from statechat.engine.output import RequestOutput
from statechat.engine.sampling import SamplingParams

SEEDS = 2**64  # seeds run to 2**64 - 1: seed + i past that wraps to 0


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of the `params.n` samples, in order (each with n = 1)."""
    return [_sample(params, i) for i in range(params.n)]


def _sample(params: SamplingParams, i: int) -> SamplingParams:
    seed = params.seed
    if seed is not None:
        seed = seed + i - SEEDS if seed + i >= SEEDS else seed + i
    return dataclasses.replace(params, n=1, seed=seed,
                               prompt_logprobs=params.prompt_logprobs if i == 0 else None)


def gather(outputs: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples' outputs, in order, as one: sample 0's, holding the others in
    `others` (see RequestOutput.outputs), each with its index and sample 0's prompt_logprobs.
    One sample's output is returned as it is."""
    first, rest = outputs[0], outputs[1:]
    if not rest:
        return first
    return dataclasses.replace(first, index=0, others=tuple(
        dataclasses.replace(out, index=i, prompt_logprobs=first.prompt_logprobs)
        for i, out in enumerate(rest, start=1)))


def with_prompt_logprobs(outputs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """Outputs of n samples per prompt in order (prompt * n + i), each with the prompt_logprobs
    of its prompt's sample 0 (the one that computed them)."""
    return [dataclasses.replace(out, prompt_logprobs=outputs[k - k % n].prompt_logprobs)
            for k, out in enumerate(outputs)]
