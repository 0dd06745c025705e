"""The evidence step (common/evidence.py) on rows in FlashRAG's layouts of HotpotQA, 2WikiMultihopQA and MuSiQue and a
corpus cut as wiki-18 cuts it (an article in 100-word passages); the expected ids are worked out from the word counts
below."""

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from common.data import DataError, read_jsonl, write_jsonl
from common.evidence import facts_of, main, norm, read_passages

ROOT = Path(__file__).resolve().parents[1]

A0 = "Arthur's Magazine (1844–1846) was an American literary periodical published in Philadelphia in the 19th century."
A1 = "Edited by T.S. Arthur, it featured work by Edgar A. Poe, J.H. Ingraham, Sarah Josepha Hale, and others."
F0 = "First for Women is a woman's magazine published by Bauer Media Group in the USA."  # 15 words
F1, F2 = "The magazine was started in 1989.", "It is based in Englewood Cliffs, New Jersey."
P0 = "Polish-Russian War (Wojna polsko-ruska) is a 2009 Polish film directed by Xawery Żuławski."
P1 = "The film is based on the novel Polish-Russian War under the white-red flag by Dorota Masłowska."
X = ["Xawery Żuławski (born 22 December 1971 in Warsaw) is a Polish film director.",
     "In 1995 he graduated from the National Film School in Łódź.",
     "He is the son of actress Małgorzata Braunek and director Andrzej Żuławski."]  # fmt: skip
G = "Green is the fourth studio album by British progressive rock musician Steve Hillage. Written in spring 1977, it was released in April 1978."  # noqa: E501
M0 = "Miquette Giraudy (born 9 February 1953, Nice, France) is a keyboard player and vocalist, best known for her work in Gong and with her partner Steve Hillage."  # noqa: E501 (27 words)
M1, M2 = "She and Hillage currently form the ambient band System 7.", "In 2011 she toured with the band."


def filler(n, tag):
    return " ".join(f"{tag}{i}" for i in range(n))


def article(title, first_id, *pieces):
    """wiki-18's cut of an article: its words in passages of 100, in corpus order, ids from first_id."""
    words = " ".join(pieces).split()
    chunks = [" ".join(words[i : i + 100]) for i in range(0, len(words), 100)]
    return [{"id": str(first_id + k), "contents": f'"{title}"\n{chunk}'} for k, chunk in enumerate(chunks)]


CORPUS = [
    *article("Arthur's Magazine", 0, A0, filler(90, "a"), A1),  # "0": A0 (words 1-15); "1": A1 (words 106-)
    # F0 is words 97-111: "First for Women is" (18 characters) in "2", the other 11 words (61 characters) in "3";
    # the corpus's article says 1988 where the row's context says 1989
    *article("First for Women", 2, filler(96, "f"), F0, "The magazine was started in 1988.", F2, filler(100, "g")),
    *article("Women's Health", 5, F1),  # F1 verbatim, under another title
    *article("Polish-Russian War (film)", 6, P0, filler(100, "p"), P1),  # P1 in "7"
    *article("Xawery Żuławski", 8, *X),
    *article("Green (Steve Hillage album)", 9, G),
    # M0 is words 91-117: its first 10 words (58 characters) in "10", 17 (97 characters) in "11"; M2 is not there
    *article("Miquette Giraudy", 10, filler(90, "m"), M0, M1, filler(50, "n")),
]


def hotpot(qid, titles, sent_ids, context):
    """A HotpotQA row as FlashRAG's hotpotqa/*.jsonl holds it."""
    return {"id": qid, "question": "Which magazine was started first?", "golden_answers": ["Arthur's Magazine"],
            "metadata": {"type": "comparison", "level": "medium",
                         "supporting_facts": {"title": titles, "sent_id": sent_ids},
                         "context": {"title": list(context), "sentences": list(context.values())}}}  # fmt: skip


CONTEXT = {"Arthur's Magazine": [A0, " " + A1], "First for Women": [F0.replace("'", "’"), " " + F1, " " + F2],
           "Nowhere Gazette": ["The Nowhere Gazette is a weekly paper."]}  # fmt: skip
HOTPOT = [
    hotpot("train_0", ["Arthur's Magazine", "First for Women", "First for Women"], [0, 0, 2], CONTEXT),
    hotpot("train_1", ["Arthur's Magazine", "Nowhere Gazette"], [1, 0], CONTEXT),  # a title not in the corpus
    hotpot("train_2", ["First for Women", "First for Women"], [1, 7], CONTEXT),  # an edited sentence; no sentence 7
]
NFD = unicodedata.normalize("NFD", "Xawery Żuławski")  # the row's title decomposed, the corpus's composed
WIKI = {"id": "dev_0", "question": "Who is the mother of the director of film Polish-Russian War (Film)?",
        "golden_answers": ["Małgorzata Braunek"],
        "metadata": {"type": "compositional",
                     "context": {"title": ["Polish-Russian War (film)", NFD], "content": [[P0, P1], X]},
                     "supporting_facts": {"title": ["Polish-Russian War (film)", NFD], "sent_id": [1, 2]},
                     "evidences": {"fact": ["Polish-Russian War", "Xawery Żuławski"],
                                   "relation": ["director", "mother"],
                                   "entity": ["Xawery Żuławski", "Małgorzata Braunek"]}}}  # fmt: skip
STEPS = [("Green >> performer", "Steve Hillage", 10, "Green (Steve Hillage album)", G),
         ("#1 >> spouse", "Miquette Giraudy", 5, "Miquette Giraudy", f"{M0} {M1} {M2}")]  # fmt: skip
MUSIQUE = {"id": "2hop__460946_294723", "question": "Who is the spouse of the Green performer?",
           "golden_answers": ["Miquette Giraudy"],
           "metadata": {"answerable": True, "question_decomposition": [
               {"id": k, "question": q, "answer": a, "paragraph_support_idx": i,
                "support_paragraph": {"idx": i, "title": t, "paragraph_text": p, "is_supporting": True}}
               for k, (q, a, i, t, p) in enumerate(STEPS)]}}  # fmt: skip
KEPT = HOTPOT[0] | {"id": "train_9", "metadata": HOTPOT[0]["metadata"] | {"supporting_doc_ids": ["99"]}}
NQ = {"id": "nq_0", "question": "who wrote hamlet ?", "golden_answers": ["Shakespeare"]}


@pytest.fixture
def files(tmp_path):
    """The rows of each dataset in its folder, and the corpus."""
    for name, rows in [("hotpotqa", [*HOTPOT, KEPT, NQ]), ("2wikimultihopqa", [WIKI]), ("musique", [MUSIQUE])]:
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "train.jsonl", rows)
    write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    names = ["hotpotqa", "2wikimultihopqa", "musique"]
    return [str(tmp_path / n / "train.jsonl") for n in names], str(tmp_path / "corpus.jsonl")


def test_the_supporting_passages_hop_fields_match_rate_and_what_did_not_match(files, tmp_path, capsys):
    rows, corpus = files
    out = tmp_path / "out" / "train.jsonl"
    main(["--corpus", corpus, "--out", str(out), *rows])
    by_id = {r["id"]: r.get("metadata") for r in read_jsonl(out)}
    assert list(by_id) == ["train_0", "train_1", "train_2", "train_9", "nq_0", "dev_0", "2hop__460946_294723"]
    # A0 in its article's first passage; F0 straddles "2" and "3" with more in "3"; F2 in "3" too: no id twice
    assert by_id["train_0"]["supporting_doc_ids"] == ["0", "3"]
    assert by_id["train_0"]["hops"] == 2 and not {"sub_queries", "sub_answers"} & set(by_id["train_0"])  # 2 titles
    assert "supporting_doc_ids" not in by_id["train_1"] and "supporting_doc_ids" not in by_id["train_2"]  # partly
    assert by_id["train_9"]["supporting_doc_ids"] == ["99"] and by_id["nq_0"] is None  # as they were
    assert by_id["dev_0"] == WIKI["metadata"] | {
        "supporting_doc_ids": ["7", "8"],
        "sub_answers": ["Xawery Żuławski", "Małgorzata Braunek"],
        "hops": 2,
    }
    # M0 straddles "10" and "11" (more in "11"), M1 in "11", M2 nowhere: the sentences found hold most of the text
    assert by_id["2hop__460946_294723"] == MUSIQUE["metadata"] | {
        "supporting_doc_ids": ["9", "11"], "sub_queries": ["Green >> performer", "#1 >> spouse"],
        "sub_answers": ["Steve Hillage", "Miquette Giraudy"], "hops": 2}  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "2wikimultihopqa: facts matched 2/2 (100.0%), rows fully matched 1/1 (100.0%)",
        "hotpotqa: facts matched 4/7 (57.1%), rows fully matched 1/3 (33.3%)",
        "musique: facts matched 2/2 (100.0%), rows fully matched 1/1 (100.0%)",
        "left as they are: 1 rows that held supporting_doc_ids, 1 rows with no supporting facts",
        f"wrote 7 rows, 3 with new evidence, to {out}",
        f"3 facts not matched: {out.parent / 'train.unmatched.jsonl'}",
    ]
    assert read_jsonl(out.parent / "train.unmatched.jsonl") == [  # the same sentence under "Women's Health": no match
        {"id": "train_1", "dataset": "hotpotqa", "title": "Nowhere Gazette", "text": CONTEXT["Nowhere Gazette"][0],
         "why": "no passage of that title in the corpus"},
        {"id": "train_2", "dataset": "hotpotqa", "title": "First for Women", "text": " " + F1,
         "why": "text not found in the title's passages"},
        {"id": "train_2", "dataset": "hotpotqa", "title": "First for Women", "text": None,
         "why": "the row holds no text for it"},
    ]  # fmt: skip


def test_partial_writes_the_matched_facts_overwrite_finds_a_kept_row_again(files, tmp_path, capsys):
    rows, corpus = files
    main(["--corpus", corpus, "--out", str(tmp_path / "o.jsonl"), "--partial", "--overwrite", *rows])
    by_id = {r["id"]: r.get("metadata") for r in read_jsonl(tmp_path / "o.jsonl")}
    assert by_id["train_1"]["supporting_doc_ids"] == ["1"]  # A1 in the second passage of its article
    assert "supporting_doc_ids" not in by_id["train_2"]  # no fact matched
    assert by_id["train_9"]["supporting_doc_ids"] == ["0", "3"]
    assert "hotpotqa: facts matched 7/10 (70.0%), rows fully matched 2/4 (50.0%)" in capsys.readouterr().out


def test_a_second_run_on_its_own_output_changes_nothing(files, tmp_path, capsys):
    rows, corpus = files
    main(["--corpus", corpus, "--out", str(tmp_path / "once.jsonl"), *rows])
    main(["--corpus", corpus, "--out", str(tmp_path / "twice.jsonl"), str(tmp_path / "once.jsonl")])
    assert (tmp_path / "twice.jsonl").read_bytes() == (tmp_path / "once.jsonl").read_bytes()
    main(["--corpus", corpus, "--out", str(tmp_path / "once.jsonl"), str(tmp_path / "once.jsonl")])  # in place
    assert (tmp_path / "once.jsonl").read_bytes() == (tmp_path / "twice.jsonl").read_bytes()
    assert "left as they are: 4 rows that held supporting_doc_ids" in capsys.readouterr().out


def test_the_original_files_layouts_give_the_same_facts():
    """Lists of pairs (HotpotQA's and 2Wiki's own json) and MuSiQue's `paragraphs` with paragraph_support_idx."""
    meta = HOTPOT[0]["metadata"]
    pairs = {"supporting_facts": [["Arthur's Magazine", 0], ["First for Women", 2]],
             "context": [[t, s] for t, s in CONTEXT.items()]}  # fmt: skip
    facts = [("Arthur's Magazine", A0), ("First for Women", " " + F2)]
    assert facts_of(pairs, "f:1") == ("hotpotqa", facts, {"hops": 2})
    assert facts_of(meta, "f:1")[1][2] == ("First for Women", " " + F2)
    steps = MUSIQUE["metadata"]["question_decomposition"]
    paragraphs = [s["support_paragraph"] for s in steps] + [{"idx": 0, "title": "Other", "paragraph_text": "x"}]
    original = {"paragraphs": paragraphs, "question_decomposition": [
        {k: v for k, v in s.items() if k != "support_paragraph"} for s in steps]}  # fmt: skip
    assert facts_of(original, "f:1") == facts_of(MUSIQUE["metadata"], "f:1")
    supporting = [("Green (Steve Hillage album)", G), ("Miquette Giraudy", f"{M0} {M1} {M2}")]
    assert facts_of({"paragraphs": paragraphs}, "f:1") == ("musique", supporting, {})  # by is_supporting


def test_the_corpus_pass_keeps_only_the_wanted_titles_passages(tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    kept = read_passages(tmp_path / "corpus.jsonl", {norm("MIQUETTE  giraudy"), norm("Absent")})
    assert list(kept) == ["miquette giraudy"] and kept["miquette giraudy"][0] == ["10", "11"]
    ids, texts, joined, starts = kept["miquette giraudy"]
    assert joined[starts[1] :].startswith(texts[1]) and joined[: len(texts[0])] == texts[0]


def test_malformed_metadata_names_the_file_and_line(tmp_path):
    bad = HOTPOT[0] | {"metadata": {"supporting_facts": {"title": ["A", "B"], "sent_id": [0]}, "context": []}}
    write_jsonl(tmp_path / "rows.jsonl", [NQ, bad])
    write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    message = f"{tmp_path / 'rows.jsonl'}:2: metadata 'supporting_facts': the lists title, sent_id differ in length"
    with pytest.raises(DataError, match=f"^{message}$"):
        main(
            [
                "--corpus",
                str(tmp_path / "corpus.jsonl"),
                "--out",
                str(tmp_path / "o.jsonl"),
                str(tmp_path / "rows.jsonl"),
            ]
        )


def test_a_malformed_line_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps(NQ) + "\n{not json\n")
    write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    out = subprocess.run(
        [sys.executable, "-m", "common.evidence", "--corpus", str(tmp_path / "corpus.jsonl"),
         "--out", str(tmp_path / "o.jsonl"), str(tmp_path / "rows.jsonl")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == f"error: {tmp_path / 'rows.jsonl'}:2: not valid JSON (Expecting property name enclosed in double quotes)"
    )  # noqa: E501
    assert not (tmp_path / "o.jsonl").exists()
