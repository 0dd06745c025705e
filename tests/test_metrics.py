"""Answer metrics against hand-worked values (FlashRAG's definitions, which SmartRAG and C-3PO evaluate with).

normalize_answer, exact_match, f1_score and sub_exact_match follow FlashRAG's evaluator (normalize_answer, ExactMatch,
F1_Score, Sub_ExactMatch); every expected value below was worked out by hand from those definitions.
"""

import pytest

from common.metrics import (
    answer_scores,
    cover_em,
    doc_recall,
    exact_match,
    f1_score,
    normalize_answer,
    sub_exact_match,
    summarize,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Beatles!", "beatles"),
        ("  the Detroit   Pistons ", "detroit pistons"),
        ("Washington, D.C.", "washington dc"),
        ("An apple a day", "apple day"),
        ("Theatre", "theatre"),  # an article only as a whole word
        ("", ""),
        ("...", ""),
        ("A\tb\nc the", "b c"),  # any white space folds to one space
        ("the-end", "theend"),  # punctuation goes before the articles: no whole word "the" is left
        ("a.k.a.", "aka"),
        ("\u00c9COLE", "\u00e9cole"),  # Unicode lower-casing
        # Changed from the old code, which applied NFC first and folded the decomposed e + U+0301 into "é":
        # FlashRAG applies no Unicode normalisation, so the combining accent stays.
        ("Beyonc\u0065\u0301", "beyonce\u0301"),
        ("Beyonc\u00e9", "beyonc\u00e9"),
        ("The\u0301", "\u0301"),  # U+0301 is not a word character, so "the" before it is a whole word
        ("Obama's", "obamas"),  # the ASCII apostrophe is punctuation...
        ("Obama\u2019s", "obama\u2019s"),  # ...the curly one is not (string.punctuation is ASCII only)
        ("\u201cHamlet\u201d", "\u201chamlet\u201d"),  # curly double quotes stay
        ("Jean-Paul Sartre", "jeanpaul sartre"),  # the hyphen goes and joins the words
        ("1939\u20131945", "1939\u20131945"),  # the en dash stays
        ("Smith\u2014Jones", "smith\u2014jones"),  # the em dash stays
        ("\u00abthe end\u00bb", "\u00ab end\u00bb"),  # guillemets stay; "the" after one is a whole word
        ("\u00bfQu\u00e9?", "\u00bfqu\u00e9"),  # the ¿ stays, the ASCII ? goes
        ("Paris\u2026", "paris\u2026"),  # the ellipsis character stays, "..." would go
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# pred, golds, EM, F1 (F1 = 2PR/(P+R) over normalised tokens)
@pytest.mark.parametrize(
    "pred, golds, em, f1",
    [
        ("Shane Acker", ["Shane Acker"], 1.0, 1.0),
        ("Tim Burton", ["Shane Acker"], 0.0, 0.0),
        ("England", ["London, England"], 0.0, 2 / 3),  # P = 1, R = 1/2
        ("Washington", ["Washington, D.C."], 0.0, 2 / 3),
        ("the Detroit Pistons", ["Detroit Pistons"], 1.0, 1.0),
        ("Start date 2004", ["2004"], 0.0, 0.5),  # P = 1/3, R = 1
        ("", ["Cotija"], 0.0, 0.0),
        ("England", ["London, England", "England"], 1.0, 1.0),  # max over aliases
        ("the the", ["a"], 1.0, 0.0),  # both normalise to empty: equal, but no tokens to overlap
        ("zorvak zorvak", ["zorvak"], 0.0, 2 / 3),  # clipped counts: overlap 1, P = 1/2, R = 1
        ("Washington", ["Washington, D.C.", "George Washington Carver"], 0.0, 2 / 3),  # max(2/3, 2*(1/3)/(4/3) = 1/2)
        ("Jean-Paul Sartre", ["Jean Paul Sartre"], 0.0, 0.4),  # "jeanpaul sartre": overlap 1, P = 1/2, R = 1/3
        ("Jean-Paul Sartre", ["JeanPaul Sartre"], 1.0, 1.0),
        ("1939 \u2013 1945", ["1939 1945"], 0.0, 0.8),  # the en dash is a token of its own: P = 2/3, R = 1
        (
            "Beyonc\u0065\u0301",
            ["Beyonc\u00e9"],
            0.0,
            0.0,
        ),  # no NFC: decomposed and composed é differ (old code: 1, 1)
    ],
)
def test_exact_match_and_f1(pred, golds, em, f1):
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1, abs=1e-9)


# FlashRAG's F1_Score scores 0 against a gold when the normalised prediction or gold is "yes", "no" or "noanswer"
# and the two differ, even if tokens overlap. Changed from the old code, which gave the token F1 (2/3 below).
@pytest.mark.parametrize(
    "pred, golds, em, f1",
    [
        ("Yes.", ["yes"], 1.0, 1.0),
        ("NO", ["no"], 1.0, 1.0),
        ("yes", ["no"], 0.0, 0.0),
        ("yes sir", ["yes"], 0.0, 0.0),  # gold is "yes", prediction differs (old: 2/3)
        ("yes", ["yes sir"], 0.0, 0.0),  # prediction is "yes", gold differs (old: 2/3)
        ("No way", ["no"], 0.0, 0.0),  # (old: 2/3)
        ("noanswer here", ["noanswer"], 0.0, 0.0),  # (old: 2/3)
        ("the answer is yes", ["yes"], 0.0, 0.0),  # (old: 1/2)
        ("no answer given", ["no answer"], 0.0, 0.8),  # "no answer" is two tokens, not the special "noanswer"
        ("yes", ["yes sir", "Yes!"], 1.0, 1.0),  # the special case is per gold; the max still finds "Yes!"
    ],
)
def test_f1_yes_no_special_case(pred, golds, em, f1):
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1, abs=1e-9)


# pred, golds, EM, F1, sub-EM (FlashRAG Sub_ExactMatch, "acc"), cover-EM: punctuation that is not ASCII stays glued
# to its word, so it breaks EM, F1 and cover-EM, while sub-EM still finds the gold inside the word.
@pytest.mark.parametrize(
    "pred, golds, em, f1, sub, cover",
    [
        ("\u201cHamlet\u201d", ["Hamlet"], 0.0, 0.0, 1.0, 0.0),
        ("Obama's", ["Obama"], 0.0, 0.0, 1.0, 0.0),  # "obamas"
        ("Obama\u2019s", ["Obama"], 0.0, 0.0, 1.0, 0.0),  # "obama’s"
        ("Obama's book", ["Obamas book"], 1.0, 1.0, 1.0, 1.0),
        ("\u00abLe Monde\u00bb", ["Le Monde"], 0.0, 0.0, 1.0, 0.0),  # "«le monde»" holds "le monde"
        ("\u00bfQu\u00e9?", ["qu\u00e9"], 0.0, 0.0, 1.0, 0.0),
        ("Paris\u2026", ["Paris"], 0.0, 0.0, 1.0, 0.0),
        ("Paris...", ["Paris"], 1.0, 1.0, 1.0, 1.0),
        ("1939\u20131945", ["1939-1945"], 0.0, 0.0, 0.0, 0.0),  # "1939–1945" against "19391945"
        ("Smith\u2014Jones", ["Smith Jones"], 0.0, 0.0, 0.0, 0.0),
        ("Jean-Paul Sartre", ["Jean Paul Sartre"], 0.0, 0.4, 0.0, 0.0),
        # golds that normalise to nothing: FlashRAG's sub-EM finds "" in every prediction; cover-EM never matches it
        ("the", ["..."], 1.0, 0.0, 1.0, 0.0),
        ("Paris", ["the"], 0.0, 0.0, 1.0, 0.0),
        ("...", ["Paris"], 0.0, 0.0, 0.0, 0.0),
        # sub-EM counts a gold inside a word ("1963" in "19634"); cover-EM wants whole tokens, so it is stricter
        ("the year 19634", ["1963"], 0.0, 0.0, 1.0, 0.0),
        ("It was the beatles, in 1963.", ["The Beatles"], 0.0, 1 / 3, 1.0, 1.0),  # 5 tokens: P = 1/5, R = 1
        ("in 1964", ["1963", "in 1964"], 1.0, 1.0, 1.0, 1.0),  # any gold will do
        ("in 1964", ["1963", "1965"], 0.0, 0.0, 0.0, 0.0),
    ],
)
def test_all_answer_metrics(pred, golds, em, f1, sub, cover):
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1, abs=1e-9)
    assert sub_exact_match(pred, golds) == sub
    assert cover_em(pred, golds) == cover
    assert answer_scores(pred, golds) == {"em": em, "f1": pytest.approx(f1, abs=1e-9), "acc": sub}


def test_a_single_string_gold_is_one_answer():
    assert exact_match("Paris", "paris") == 1.0
    assert f1_score("Paris France", "Paris") == pytest.approx(2 / 3)
    assert sub_exact_match("Paris, France", "paris") == 1.0
    # a string is not split into characters: "P" would equal the gold "p", and "r" is inside "rome"
    assert exact_match("P", "Paris") == 0.0
    assert f1_score("P", "Paris") == 0.0
    assert sub_exact_match("Rome", "Paris") == 0.0
    assert cover_em("Rome", "Paris") == 0.0


def test_empty_gold_list_scores_zero():
    assert exact_match("x", []) == 0.0
    assert f1_score("x", []) == 0.0
    assert sub_exact_match("x", []) == 0.0
    assert cover_em("x", []) == 0.0
    assert sub_exact_match("", []) == 0.0  # no gold at all, not even an empty one, so nothing is a substring


@pytest.mark.parametrize(
    "pred, golds, expected",
    [
        ("It was the beatles, in 1963.", ["The Beatles"], 1.0),
        ("in 1964", ["1963"], 0.0),
        ("the year 19634", ["1963"], 0.0),  # whole tokens only (sub_exact_match gives 1.0 here)
        ("Café de Flore", ["cafe"], 0.0),  # no accent folding
        ("Le café de Flore", ["Café"], 1.0),
        ("anything", ["the"], 0.0),  # a gold that normalises to empty never matches
    ],
)
def test_cover_em(pred, golds, expected):
    assert cover_em(pred, golds) == expected


def test_doc_recall():
    assert doc_recall(["d1", "d2", "d3"], ["d2", "d9"]) == 0.5
    assert doc_recall([], ["d1"]) == 0.0
    assert doc_recall(["d1", "d1"], ["d1"]) == 1.0
    assert doc_recall(["d1"], []) == 1.0


def test_answer_scores_are_em_f1_and_sub_em():
    assert answer_scores("Start date 2004", ["2004"]) == {"em": 0.0, "f1": 0.5, "acc": 1.0}
    assert answer_scores("the Detroit Pistons", "Detroit Pistons") == {"em": 1.0, "f1": 1.0, "acc": 1.0}
    assert answer_scores("yes sir", ["yes"]) == {"em": 0.0, "f1": 0.0, "acc": 1.0}
    assert list(answer_scores("x", [])) == ["em", "f1", "acc"] and set(answer_scores("x", []).values()) == {0.0}


def test_summarize_means_overall_and_by_group_with_counts_and_shares():
    rows = [
        {"metadata": {"type": "one_hop", "popular": True, "answerable": True}},
        {"metadata": {"type": "one_hop", "popular": False, "answerable": True}},
        {"metadata": {"type": "two_hop", "popular": False, "answerable": False, "hops": 2}},  # hops: no group
        {"metadata": None},  # a FlashRAG row without metadata counts overall only
        {},
    ]
    records = [
        {"em": 1.0, "retrievals": 0, "strategy": "No Retrieval"},
        {"em": 0.0, "retrievals": 2, "strategy": "Retrieval", "hit": 1.0},
        {"em": 1.0, "retrievals": 1, "strategy": "Retrieval", "hit": 0.0},
        {"em": 0.0, "retrievals": 3, "strategy": "Planning", "hit": 1.0},
        {"em": 0.5, "retrievals": 4, "strategy": "Retrieval"},
    ]
    out = summarize(records, rows, {"strategy": "strategies"})
    groups = out.pop("groups")
    assert out == {
        "em": pytest.approx(2.5 / 5),
        "retrievals": pytest.approx(10 / 5),
        "strategies": {"No Retrieval": pytest.approx(1 / 5), "Planning": pytest.approx(1 / 5), "Retrieval": 3 / 5},
        "hit": pytest.approx(2 / 3),  # averaged over the 3 records that have it, not over 5
        "n": 5,
    }
    assert list(out["strategies"]) == ["No Retrieval", "Planning", "Retrieval"]  # sorted
    assert set(groups) == {"type=one_hop", "type=two_hop", "popular=True", "popular=False", "answerable=True",
                           "answerable=False"}  # fmt: skip
    assert groups["type=one_hop"] == {
        "em": 0.5,
        "retrievals": 1.0,
        "strategies": {"No Retrieval": 0.5, "Retrieval": 0.5},
        "hit": 1.0,  # one of the two has a hit
        "n": 2,
    }
    assert groups["popular=False"] == {
        "em": 0.5,
        "retrievals": 1.5,
        "strategies": {"Retrieval": 1.0},
        "hit": 0.5,
        "n": 2,
    }
    assert groups["popular=True"] == {"em": 1.0, "retrievals": 0.0, "strategies": {"No Retrieval": 1.0}, "n": 1}
    assert groups["answerable=False"]["n"] == groups["type=two_hop"]["n"] == 1
    plain = summarize([{"em": 1.0}, {"em": 0.0, "f1": 0.5}], [{}, {}])  # no distributions: every field a mean
    assert plain == {"em": 0.5, "f1": 0.5, "n": 2, "groups": {}}
