"""Answer metrics against hand-worked values (SmartRAG spec §8.1, C-3PO spec §8.8)."""
import pytest

from common.metrics import cover_em, doc_recall, exact_match, f1_score, normalize_answer


@pytest.mark.parametrize("text, expected", [
    ("The Beatles!", "beatles"),
    ("  the Detroit   Pistons ", "detroit pistons"),
    ("Washington, D.C.", "washington dc"),
    ("An apple a day", "apple day"),
    ("Theatre", "theatre"),          # an article only as a whole word
    ("", ""),
    ("...", ""),
    ("Beyonc\u0065\u0301", "beyonc\u00e9"),  # decomposed é folds to the composed form
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# pred, golds, EM, F1: SmartRAG spec §8.1 (F1 = 2PR/(P+R))
@pytest.mark.parametrize("pred, golds, em, f1", [
    ("Shane Acker", ["Shane Acker"], 1.0, 1.0),
    ("Tim Burton", ["Shane Acker"], 0.0, 0.0),
    ("England", ["London, England"], 0.0, 2 / 3),       # P = 1, R = 1/2
    ("Washington", ["Washington, D.C."], 0.0, 2 / 3),
    ("the Detroit Pistons", ["Detroit Pistons"], 1.0, 1.0),
    ("Start date 2004", ["2004"], 0.0, 0.5),              # P = 1/3, R = 1
    ("", ["Cotija"], 0.0, 0.0),
    ("England", ["London, England", "England"], 1.0, 1.0),  # max over aliases
    ("the the", ["a"], 1.0, 0.0),                        # both normalise to empty: equal, but no tokens to overlap
    ("zorvak zorvak", ["zorvak"], 0.0, 2 / 3),          # clipped counts: overlap 1, P = 1/2, R = 1
])
def test_exact_match_and_f1(pred, golds, em, f1):
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1, abs=1e-9)


def test_a_single_string_gold_is_one_answer():
    assert exact_match("Paris", "paris") == 1.0
    assert f1_score("Paris France", "Paris") == pytest.approx(2 / 3)


def test_empty_gold_list_scores_zero():
    assert exact_match("x", []) == 0.0
    assert f1_score("x", []) == 0.0
    assert cover_em("x", []) == 0.0


@pytest.mark.parametrize("pred, golds, expected", [
    ("It was the beatles, in 1963.", ["The Beatles"], 1.0),
    ("in 1964", ["1963"], 0.0),
    ("the year 19634", ["1963"], 0.0),      # whole tokens only
    ("Café de Flore", ["cafe"], 0.0),         # no accent folding
    ("Le café de Flore", ["Café"], 1.0),
    ("anything", ["the"], 0.0),              # a gold that normalises to empty never matches
])
def test_cover_em(pred, golds, expected):
    assert cover_em(pred, golds) == expected


def test_doc_recall():
    assert doc_recall(["d1", "d2", "d3"], ["d2", "d9"]) == 0.5
    assert doc_recall([], ["d1"]) == 0.0
    assert doc_recall(["d1", "d1"], ["d1"]) == 1.0
    assert doc_recall(["d1"], []) == 1.0
