"""`statechat batch -o FILE` takes any FILE its file system takes: a name near the 255-byte
limit gets its results (the temporary file beside it was named FILE's name and more, too long
a name: `cannot write FILE (File name too long)` once the model had run), and a run stopped
early keeps its finished results in a FILE.partial cut short to fit (they were lost)."""

from __future__ import annotations

import pytest

from statechat.cli_batch import Interrupted, results

RECORD = '{"id": 1}\n'


def test_a_results_file_named_near_the_limit_gets_its_results(tmp_path):
    output = tmp_path / ("r" * 240 + ".jsonl")
    with results(output, direct=False) as sink:
        sink.write(RECORD)
    assert output.read_text() == RECORD
    assert [p.name for p in tmp_path.iterdir()] == [output.name]


def test_a_stopped_run_keeps_its_results_beside_a_long_name(tmp_path):
    output = tmp_path / ("é" * 120 + ".jsonl")  # (250 bytes in UTF-8)
    with pytest.raises(Interrupted) as stopped, results(output, direct=False) as sink:
        sink.write(RECORD)
        raise KeyboardInterrupt
    [kept] = tmp_path.iterdir()
    assert kept.name.endswith(".partial") and kept.read_text() == RECORD
    assert f"the first result (input order) is in {kept}" in str(stopped.value)
