"""The masks of a step's structured rows (Grammars.mask): computed side by side on
llguidance's threads, each row's mask is the one it gets alone, a finished row or one whose
constraint has not started allows every token; where the batch's computation fails, the rows
are computed one by one and a row that fails there may only end, alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from statechat.engine.sampling import SamplingParams
from statechat.engine.structured import Grammars, StructuredOutput
from statechat.paths import EMBEDDED_MODEL
from tests.engine.test_structured import CONSTRAINTS

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def row(seq_id: int, s: StructuredOutput, reply: list[int], finished: bool = False):
    """A sequence as Grammars reads it: prompt [1, 2, 3], then `reply`."""
    return SimpleNamespace(seq_id=seq_id, request_id=f"r{seq_id}", is_finished=finished,
                           params=SamplingParams(structured=s), num_prompt_tokens=3,
                           token_ids=[1, 2, 3, *reply])


def rows(tokenizer) -> list:
    json_start = tokenizer.encode('{"color":"', add_special_tokens=False)
    after = StructuredOutput(regex="[ab]+", after_token=7)
    return [row(0, CONSTRAINTS[0], json_start), row(1, CONSTRAINTS[1], []),
            row(2, CONSTRAINTS[2], tokenizer.encode("gam", add_special_tokens=False)),
            row(3, after, [5]), row(4, CONSTRAINTS[1], [], finished=True),
            row(5, CONSTRAINTS[0], [])]


def masks_alone(tokenizer, seqs: list) -> torch.Tensor:
    return torch.cat([Grammars(tokenizer, len(tokenizer), {EOS}).mask([s], 400, torch.device(
        "cpu")) for s in seqs])


def test_rows_computed_together_get_the_masks_they_get_alone(tokenizer, monkeypatch):
    import llguidance.torch as llt

    seqs, batches, par = rows(tokenizer), [], llt.fill_next_token_bitmask_par

    def counted(executor, matchers, bits):
        batches.append([i for _, i in matchers])
        par(executor, matchers, bits)

    monkeypatch.setattr(llt, "fill_next_token_bitmask_par", counted)
    together = Grammars(tokenizer, len(tokenizer), {EOS}).mask(seqs, 400, torch.device("cpu"))
    assert batches == [[0, 1, 2, 5]] and torch.equal(together, masks_alone(tokenizer, seqs))
    vocab = len(tokenizer)  # (the logits are wider: the columns past it are never drawn)
    assert together[3, :vocab].all() and together[4, :vocab].all()  # (not started; finished)
    assert not together[0, :vocab].all() and not together[:, vocab:].any()


def test_a_failed_batch_is_computed_row_by_row_and_a_failing_row_ends_alone(
        tokenizer, monkeypatch, caplog):
    import llguidance.torch as llt

    seqs, fill = rows(tokenizer), llt.fill_next_token_bitmask

    def failing_batch(*args, **kwargs):
        raise RuntimeError("the threads failed")

    def failing_row(matcher, bits, i):
        if i == 1:
            raise RuntimeError("row 1's matcher failed")
        fill(matcher, bits, i)

    monkeypatch.setattr(llt, "fill_next_token_bitmask_par", failing_batch)
    grammars = Grammars(tokenizer, len(tokenizer), {EOS})
    assert torch.equal(grammars.mask(seqs, 400, torch.device("cpu")),
                       masks_alone(tokenizer, seqs))
    monkeypatch.setattr(llt, "fill_next_token_bitmask", failing_row)
    got = Grammars(tokenizer, len(tokenizer), {EOS}).mask(seqs, 400, torch.device("cpu"))
    assert got[1].nonzero().flatten().tolist() == [EOS]
    monkeypatch.setattr(llt, "fill_next_token_bitmask", fill)
    want = masks_alone(tokenizer, seqs)
    assert torch.equal(got[[0, 2, 3, 4, 5]], want[[0, 2, 3, 4, 5]])
    assert "request r1 failed" in caplog.text
