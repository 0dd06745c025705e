"""Answer metrics as in SQuAD/FlashRAG: normalisation, exact match, token F1, cover-EM, document recall."""
import re
import string
import unicodedata
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s):
    """SQuAD normalisation: lower case, drop punctuation and the articles a/an/the, fold white space."""
    s = unicodedata.normalize("NFC", s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _as_list(golds):
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(pred, golds):
    """1.0 if the normalised prediction equals some normalised gold answer, else 0.0."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _as_list(golds)))


def _f1(pred_tokens, gold_tokens):
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred, golds):
    """Token-level F1 between the normalised prediction and the best-matching gold answer."""
    p = normalize_answer(pred).split()
    return max((_f1(p, normalize_answer(g).split()) for g in _as_list(golds)), default=0.0)


def cover_em(pred, golds):
    """1.0 if some normalised gold answer appears as a whole-token span of the normalised prediction."""
    p = f" {normalize_answer(pred)} "
    return float(any(normalize_answer(g) and f" {normalize_answer(g)} " in p for g in _as_list(golds)))


def doc_recall(retrieved_ids, gold_ids):
    """Fraction of the gold (supporting) document ids found among the retrieved ids; 1.0 when there are none."""
    gold = set(gold_ids)
    return len(gold & set(retrieved_ids)) / len(gold) if gold else 1.0
