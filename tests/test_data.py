"""FlashRAG QA loading: good files load, every kind of bad line names its file and line."""
import json

import pytest

from common.data import DataError, load_qa, read_jsonl, sample_rows, write_jsonl

GOOD = [
    {"id": "q1", "question": "who directed kanikx ?", "golden_answers": ["velbo"], "metadata": {"hops": 1}},
    {"id": "q2", "question": "where was velbo born ?", "golden_answers": ["orsa", "orsa city"]},
]


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_qa_reads_rows_and_defaults_metadata(tmp_path):
    path = write(tmp_path / "qa.jsonl", [json.dumps(r) for r in GOOD] + [""])  # a blank line is skipped
    rows = load_qa(path)
    assert [r["id"] for r in rows] == ["q1", "q2"]
    assert rows[0]["metadata"] == {"hops": 1}
    assert rows[1]["metadata"] == {}
    assert rows[1]["golden_answers"] == ["orsa", "orsa city"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"id": "q3", "question": "x ?"', "not valid JSON"),
    ('["q3", "x ?"]', "expected a JSON object"),
    ('{"id": "q3", "golden_answers": ["a"]}', "missing field 'question'"),
    ('{"id": "q3", "question": "x ?"}', "missing field 'golden_answers'"),
    ('{"id": "q3", "question": "x ?", "golden_answers": []}', "non-empty list of strings"),
    ('{"id": "q3", "question": "x ?", "golden_answers": "a"}', "non-empty list of strings"),
    ('{"id": "q3", "question": "x ?", "golden_answers": [1]}', "non-empty list of strings"),
    ('{"id": "q3", "question": "  ", "golden_answers": ["a"]}', "'question' must be a non-empty string"),
    ('{"id": "q3", "question": "x ?", "golden_answers": ["a"], "metadata": 3}', "'metadata' must be an object"),
])
def test_bad_lines_name_file_and_line(tmp_path, bad_line, message):
    path = write(tmp_path / "qa.jsonl", [json.dumps(GOOD[0]), "", bad_line])
    with pytest.raises(DataError) as err:
        load_qa(path)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_qa(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no rows"):
        load_qa(write(tmp_path / "empty.jsonl", [""]))


def test_write_then_read_round_trip_is_atomic(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, GOOD)
    assert read_jsonl(path, required=("id",)) == GOOD
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]  # no temporary file left behind


def test_sample_rows_is_seeded_and_without_replacement():
    rows = [{"id": i} for i in range(50)]
    a, b, c = sample_rows(rows, 10, seed=1), sample_rows(rows, 10, seed=1), sample_rows(rows, 10, seed=2)
    assert a == b and a != c
    assert len({r["id"] for r in a}) == 10
    everything = sample_rows(rows, None, seed=0)
    assert sorted(r["id"] for r in everything) == list(range(50))
    assert len(sample_rows(rows, 500, seed=0)) == 50


def test_load_split_keeps_the_types_asked_for(tmp_path):
    from common.data import load_split
    rows = [{"id": str(i), "question": f"q{i} ?", "golden_answers": ["a"], "metadata": {"type": t}}
            for i, t in enumerate(["one_hop", "two_hop", "one_hop", "comparison"])]
    write_jsonl(tmp_path / "test.jsonl", rows)
    assert [r["id"] for r in load_split(tmp_path, "test", "one_hop")] == ["0", "2"]
    assert [r["id"] for r in load_split(tmp_path, "test", "two_hop,comparison")] == ["1", "3"]
    assert len(load_split(tmp_path, "test", "")) == 4 and load_split(tmp_path, "test", "three_hop") == []
