"""A bad grammar given to a structured output is a ConfigError of one line, as a bad regex or
schema is (engine/structured.py's promise), whatever the grammar's syntax (GBNF or Lark)."""

from __future__ import annotations

import pytest

from statechat.engine.structured import StructuredOutput
from statechat.errors import ConfigError


@pytest.mark.parametrize("kind, value", [("regex", "[a-"), ("json", {"type": "nothing"}),
                                         ("grammar", "start: (x")])
def test_a_bad_spec_is_a_config_error(kind, value):
    with pytest.raises(ConfigError, match="is not valid"):
        StructuredOutput(**{kind: value})


def test_a_bad_gbnf_grammar_is_a_config_error():
    with pytest.raises(ConfigError):
        StructuredOutput(grammar="root ::= (")
