"""Answer metrics equal to FlashRAG's evaluator (flashrag/evaluator/metrics.py and utils.py) on every input.

  normalize_answer  FlashRAG's normalize_answer (the SQuAD one): lower case, drop ASCII `string.punctuation`,
                    drop the whole words a/an/the, fold white space. No Unicode normalisation (NFC, accents),
                    and non-ASCII punctuation (curly quotes, dashes, « », ¿, …) is kept as it is.
  exact_match       ExactMatch ("em"): the normalised prediction equals some normalised gold answer.
  f1_score          F1_Score ("f1"): best token F1 over the gold answers; 0 for a gold whose tokens do not
                    overlap, and 0 when the normalised prediction or gold is "yes", "no" or "noanswer" and
                    the two differ.
  sub_exact_match   Sub_ExactMatch ("acc", Search-R1's sub-EM, the "accuracy" of many agentic-RAG papers):
                    some normalised gold answer is a substring of the normalised prediction, even inside a
                    word ("1963" in "19634"); a gold that normalises to "" is in every prediction.
  cover_em          stricter than sub_exact_match: the gold must cover whole tokens of the prediction and a gold
                    that normalises to "" never matches. Not a FlashRAG metric.
  doc_recall        fraction of the gold document ids that were retrieved.
Gold answers are a list of strings or one string; an empty list scores 0. FlashRAG's regex mode for the
curatedtrec data set (gold answers as patterns) is not reproduced.
"""

import re
import string
from collections import Counter, defaultdict

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)  # ASCII only, as in FlashRAG
_YES_NO = ("yes", "no", "noanswer")


def normalize_answer(s):
    """Lower case, drop ASCII punctuation, then the articles a/an/the as whole words, fold white space."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _as_list(golds):
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(pred, golds):
    """1.0 if the normalised prediction equals some normalised gold answer, else 0.0 (FlashRAG ExactMatch)."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in _as_list(golds)))


def _f1(p, g):
    if p != g and (p in _YES_NO or g in _YES_NO):
        return 0.0  # a yes/no/noanswer answer scores only when it is matched exactly
    common = sum((Counter(p.split()) & Counter(g.split())).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p.split()), common / len(g.split())
    return 2 * precision * recall / (precision + recall)


def f1_score(pred, golds):
    """Token F1 of the normalised prediction against the best gold answer (FlashRAG F1_Score)."""
    p = normalize_answer(pred)
    return max((_f1(p, normalize_answer(g)) for g in _as_list(golds)), default=0.0)


def sub_exact_match(pred, golds):
    """1.0 if some normalised gold answer is a substring of the normalised prediction (FlashRAG Sub_ExactMatch)."""
    p = normalize_answer(pred)
    return float(any(normalize_answer(g) in p for g in _as_list(golds)))


def cover_em(pred, golds):
    """1.0 if some normalised gold answer appears as a whole-token span of the normalised prediction."""
    p = f" {normalize_answer(pred)} "
    return float(any(normalize_answer(g) and f" {normalize_answer(g)} " in p for g in _as_list(golds)))


def doc_recall(retrieved_ids, gold_ids):
    """Fraction of the gold (supporting) document ids found among the retrieved ids; 1.0 when there are none."""
    gold = set(gold_ids)
    return len(gold & set(retrieved_ids)) / len(gold) if gold else 1.0


def answer_scores(prediction, golds):
    """EM, F1 and acc (FlashRAG's Sub_ExactMatch: a gold alias inside the prediction) of one prediction."""
    return {
        "em": exact_match(prediction, golds),
        "f1": f1_score(prediction, golds),
        "acc": sub_exact_match(prediction, golds),
    }


def summarize(records, rows, distributions=None):
    """Means of the records' numeric fields (one record per question, a field absent from some records averaged over
    those that have it) overall and by metadata group ("type=...", "popular=...", "answerable=..."), each with its
    count n, as {**overall, "groups": {group: {...}}}. `distributions` maps categorical fields to the key of their
    shares (e.g. {"strategy": "strategies"})."""
    distributions, groups = distributions or {}, defaultdict(list)
    for record, row in zip(records, rows):
        meta = row.get("metadata") or {}
        for key in ["all"] + [f"{k}={meta[k]}" for k in ("type", "popular", "answerable") if k in meta]:
            groups[key].append(record)

    def summary(group):
        out = {}
        for name in dict.fromkeys(k for r in group for k in r):
            values = [r[name] for r in group if name in r]
            if name in distributions:
                counts = Counter(values)
                out[distributions[name]] = {v: counts[v] / len(values) for v in sorted(counts)}
            else:
                out[name] = sum(values) / len(values)
        return out | {"n": len(group)}

    out = {key: summary(group) for key, group in groups.items()}
    return out.pop("all") | {"groups": out}
