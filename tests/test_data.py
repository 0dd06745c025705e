"""FlashRAG QA loading: good files load, every kind of bad line names its file and line."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from common.data import DataError, UserError, load_qa, load_split, read_jsonl, sample_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"id": "q3", "question": "x ?"', "not valid JSON"),
        ('["q3", "x ?"]', "expected a JSON object"),
        ('{"id": "q3", "golden_answers": ["a"]}', "missing field 'question'"),
        ('{"id": "q3", "question": "x ?"}', "missing field 'golden_answers'"),
        ('{"id": "q3", "question": "x ?", "golden_answers": []}', "non-empty list of strings"),
        ('{"id": "q3", "question": "x ?", "golden_answers": "a"}', "non-empty list of strings"),
        ('{"id": "q3", "question": "x ?", "golden_answers": [1]}', "non-empty list of strings"),
        ('{"id": "q3", "question": "  ", "golden_answers": ["a"]}', "'question' must be a non-empty string"),
        ('{"id": "q3", "question": "x ?", "golden_answers": ["a"], "metadata": 3}', "'metadata' must be an object"),
        ('{"question": "x ?", "golden_answers": ["a"]}', "missing field 'id'"),
        (
            '{"id": null, "question": "x ?", "golden_answers": ["a"]}',
            "field 'id' must be a non-empty string or an int",
        ),
        ('{"id": " ", "question": "x ?", "golden_answers": ["a"]}', "field 'id' must be a non-empty string or an int"),
        ('{"id": "q3", "question": "x ?", "golden_answers": [""]}', "field 'golden_answers' holds only empty answers"),
        ('{"id": "q3", "question": "x ?", "golden_answers": [" ", "\\t"]}', "field 'golden_answers' holds only empty"),
        ('{"id": "q3", "question": "x ?", "answers": []}', "field 'answers' must be a non-empty list of strings"),
        ('{"id": "q3", "question": "x ?", "answers": ["", " "]}', "field 'answers' holds only empty answers"),
        ('{"id": "q3", "question": "x ?", "answer": ["a"]}', "missing field 'golden_answers' (or 'answers')"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, bad_line, message):
    path = write(tmp_path / "qa.jsonl", [json.dumps(GOOD[0]), "", bad_line])
    with pytest.raises(DataError) as err:
        load_qa(path)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_errors_are_user_errors():
    assert issubclass(DataError, UserError) and issubclass(UserError, ValueError)


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    path = tmp_path / "qa.jsonl"
    good = json.dumps(GOOD[0]).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + b'{"id": "q3", "question": "caf\xe9 ?", "golden_answers": ["a"]}\n')
    with pytest.raises(DataError) as err:
        load_qa(path)
    assert str(err.value) == f"{path}:3: not valid UTF-8 (byte 0xe9 at column 30)"


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in GOOD).encode() + b"\r\n")
    assert [r["id"] for r in load_qa(path)] == ["q1", "q2"]


def test_answers_is_read_as_golden_answers_and_blank_answers_beside_real_ones_are_dropped(tmp_path):
    path = write(
        tmp_path / "qa.jsonl",
        [
            json.dumps({"id": 7, "question": "who ?", "answers": ["velbo", "vel bo"]}),  # C-3PO's raw format
            json.dumps({"id": "q2", "question": "where ?", "golden_answers": ["orsa", " ", ""]}),
            json.dumps({"id": "q3", "question": "when ?", "golden_answers": ["1941"], "answers": ["other"]}),
        ],
    )
    rows = load_qa(path)
    assert rows[0]["golden_answers"] == ["velbo", "vel bo"] and "answers" not in rows[0]
    assert rows[1]["golden_answers"] == ["orsa"]  # a blank gold answer would match an empty prediction
    assert rows[2]["golden_answers"] == ["1941"]  # golden_answers wins when both are given


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


def typed_rows(types):
    return [
        {"id": str(i), "question": f"q{i} ?", "golden_answers": ["a"], "metadata": {"type": t} if t else {}}
        for i, t in enumerate(types)
    ]


def test_load_split_keeps_the_types_asked_for(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", typed_rows(["one_hop", "two_hop", "one_hop", "comparison", None]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching filter warns about nothing
        assert [r["id"] for r in load_split(tmp_path, "test", "one_hop")] == ["0", "2"]
        assert [r["id"] for r in load_split(tmp_path, "test", "two_hop, comparison")] == ["1", "3"]
        assert [r["id"] for r in load_split(tmp_path, "test", ["comparison"])] == ["3"]
        assert len(load_split(tmp_path, "test", "")) == len(load_split(tmp_path, "test", None)) == 5


def test_load_split_refuses_a_filter_that_matches_no_typed_row(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", typed_rows(["two_hop", None, "comparison", "two_hop"]))
    with pytest.raises(DataError) as err:
        load_split(tmp_path, "test", "one_hop,three_hop")
    assert str(err.value) == (
        f"{tmp_path / 'test.jsonl'}: no row of type one_hop, three_hop; the types present are comparison, two_hop"
    )


def test_load_split_without_any_type_ignores_the_filter_and_says_so(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", typed_rows([None, None, None]))  # a plain FlashRAG dataset
    with pytest.warns(UserWarning, match=r"train\.jsonl: no row has a metadata 'type'.*one_hop.*all 3 rows"):
        rows = load_split(tmp_path, "train", "one_hop")
    assert [r["id"] for r in rows] == ["0", "1", "2"]


def test_mix_samples_each_file_prefixes_ids_and_converts_raw_rows(tmp_path):
    from common.data import main, mix

    (tmp_path / "nq").mkdir(), (tmp_path / "hotpotqa").mkdir()
    nq = [{"id": f"train_{i}", "question": f"q{i} ?", "golden_answers": [f"a{i}"]} for i in range(5)]
    write_jsonl(tmp_path / "nq" / "train.jsonl", nq)
    raw = {"id": "train_0", "question": "h ?", "answers": ["c"], "metadata": {"type": "bridge"}}  # C-3PO's raw row
    write_jsonl(tmp_path / "hotpotqa" / "train.jsonl", [raw])
    rows = mix([tmp_path / "nq" / "train.jsonl", tmp_path / "hotpotqa" / "train.jsonl"], n=2, seed=3)
    assert [r["id"] for r in rows[:2]] == [f"nq/{r['id']}" for r in sample_rows(nq, 2, 3)]  # seeded, per file
    assert rows[2] == {"id": "hotpotqa/train_0", "question": "h ?", "golden_answers": ["c"],
                       "metadata": {"type": "bridge", "dataset": "hotpotqa"}}  # fmt: skip
    assert len({r["id"] for r in mix([tmp_path / "nq" / "train.jsonl"] * 2)}) == 5  # the same file twice: same ids
    main(["--out", str(tmp_path / "out" / "train.jsonl"), str(tmp_path / "nq" / "train.jsonl")])
    assert [r["id"] for r in load_qa(tmp_path / "out" / "train.jsonl")] == [
        f"nq/{r['id']}" for r in sample_rows(nq, None, 0)
    ]


def test_mix_command_line_reports_a_malformed_file_in_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text("garbage\n")
    out = subprocess.run([sys.executable, "-m", "common.data", "--out", str(tmp_path / "o.jsonl"),
                          str(tmp_path / "bad.jsonl")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert (
        out.returncode == 2
        and out.stderr.strip() == f"error: {tmp_path / 'bad.jsonl'}:1: not valid JSON (Expecting value)"
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_missing_metadata_is_one_line_naming_the_row_the_fields_and_the_need():
    from common.data import require_metadata

    rows = [{"id": "a", "metadata": {"hops": 1, "relations": ["x"]}}, {"id": 7, "metadata": {"hops": 2}}]
    require_metadata(rows[:1], ["hops", "relations"], "d/train.jsonl", "the toy oracle teacher")
    with pytest.raises(DataError, match=r"^d/train.jsonl: row 7 has no metadata 'relations', which the toy oracle"):
        require_metadata(rows, ["hops", "relations"], "d/train.jsonl", "the toy oracle teacher")
