"""The toy reader's note and confidence modes (SPARC-RAG's Context Manager and the naive sequential baseline)."""

import json
from pathlib import Path

import pytest

from common.toy import ToyReader

WORLD = Path(__file__).resolve().parents[1] / "data" / "toy"


@pytest.fixture(scope="module")
def reader():
    return ToyReader(WORLD)


@pytest.fixture(scope="module")
def world(reader):
    corpus = {}
    for line in (WORLD / "corpus.jsonl").read_text().splitlines():
        row = json.loads(line)
        corpus[row["id"]] = row["contents"].split("\n", 1)[1]
    rows = [json.loads(line) for line in (WORLD / "test.jsonl").read_text().splitlines()]
    return corpus, rows


def first(rows, kind, popular=False, decoys=True):
    return next(
        r
        for r in rows
        if r["metadata"]["type"] == kind
        and r["metadata"]["popular_hops"][0] == popular
        and bool(r["metadata"]["distractor_doc_ids"]) == decoys
        and r["metadata"]["answerable"]
    )


def test_note_keeps_the_questions_links_with_exact_names_and_drops_decoys(reader, world):
    corpus, rows = world
    row = first(rows, "two_hop")
    gold = [corpus[i] for i in row["metadata"]["supporting_doc_ids"]]
    decoy = corpus[row["metadata"]["distractor_doc_ids"][0]]
    prompt = f"original query : {row['question']} old note : new information : {gold[0]} {decoy} updated note :"
    head, rel = row["metadata"]["entities"][0], row["metadata"]["sub_answers"][0]
    note = reader.reply(prompt)
    assert note.startswith(head) and rel in note and note.count(" . ") == 0 and note.endswith(".")
    assert decoy.split()[0] not in note  # the near name's statement is dropped ...
    assert reader.reply(f"{gold[0]} {decoy} question : {row['question']}") != row["metadata"]["sub_answers"][-1]
    prompt = f"original query : {row['question']} old note : {note} new information : {gold[1]} updated note : [END]"
    full = reader.reply(prompt)
    assert full.startswith(note) and full.endswith(f"{row['golden_answers'][0]} . [END]")  # both links, in order
    answer = reader.reply(f"answer the question based on the notes . notes : {full[:-6]} question : {row['question']}")
    assert answer == row["golden_answers"][0]


def test_note_merge_keeps_each_fact_once_and_nothing_off_the_question(reader, world):
    corpus, rows = world
    row = first(rows, "comparison")
    a, b = (corpus[i] for i in row["metadata"]["supporting_doc_ids"])
    other = corpus[first(rows, "one_hop")["metadata"]["supporting_doc_ids"][0]]
    merged = reader.reply(
        f"combine the notes into a single note for {row['question']} . notes : note 1 : {a} note 2 : {b} {a} {other}"
    )
    assert merged.count(" . ") == 1 and merged.endswith(".")  # one year sentence per entity, once each
    assert merged.split(" . ")[0].split()[0] == row["metadata"]["entities"][0]  # the question's order
    assert reader.reply(f"updated note : {other}") == ""  # no question: an empty note


def test_popular_links_are_followed_through_memory_but_not_written(reader, world):
    corpus, rows = world
    row = first(rows, "two_hop", popular=True, decoys=False)
    second = corpus[row["metadata"]["supporting_doc_ids"][1]]
    note = reader.reply(f"original query : {row['question']} old note : new information : {second} updated note :")
    assert note.startswith(row["metadata"]["entities"][1]) and row["metadata"]["entities"][0] not in note.split()[:1]


def test_confidence_mode(reader, world):
    corpus, rows = world
    row = first(rows, "one_hop", decoys=False)
    doc = corpus[row["metadata"]["supporting_doc_ids"][0]]
    assert reader.reply(f"documents : {doc} question : {row['question']} answer : x confidence :") == "1.0"
    assert reader.reply(f"documents : question : {row['question']} answer : x confidence : [END]") == "0.0 [END]"
