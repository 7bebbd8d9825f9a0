"""A bad grammar given to a structured output is a ConfigError of one line, as a bad regex or
schema is (engine/structured.py's promise), whatever the grammar's syntax (GBNF or Lark); one
that only this model's tokenizer finds wrong (a special token it lacks, a token id past its
vocabulary) is refused when the request is added, not answered with an empty reply."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.engine.structured import StructuredOutput
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import cpu_engine


@pytest.mark.parametrize("kind, value", [("regex", "[a-"), ("json", {"type": "nothing"}),
                                         ("grammar", "start: (x")])
def test_a_bad_spec_is_a_config_error(kind, value):
    with pytest.raises(ConfigError, match="is not valid"):
        StructuredOutput(**{kind: value})


def test_a_bad_gbnf_grammar_is_a_config_error():
    with pytest.raises(ConfigError):
        StructuredOutput(grammar="root ::= (")


@pytest.mark.parametrize("grammar, message", [
    ('start: <|not_a_token|> "x"', "unknown special token"),
    ("start: <[100000]>", "too large"),
])
def test_a_grammar_this_tokenizer_cannot_follow_is_refused(tiny_dirs, grammar, message):
    """Each was a reply of no tokens, finished as 'stop', with nothing said."""
    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)
    engine = cpu_engine(loaded, enable_prefix_cache=False)
    params = SamplingParams(max_tokens=8, structured={"grammar": grammar})
    with pytest.raises(ConfigError, match=message) as err:
        engine.generate([[5, 6, 7]], params)
    assert "\n" not in str(err.value) and not engine.has_unfinished()
