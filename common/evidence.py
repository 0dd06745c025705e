"""The evidence step: each question's supporting passages in a FlashRAG corpus, from the supporting facts of FlashRAG's
HotpotQA, 2WikiMultihopQA and MuSiQue rows, written into the rows' metadata (data/README.md, "The evidence step"):

    python -m common.evidence --corpus wiki18_100w.jsonl --out data/tearag/train.jsonl flashrag/musique/train.jsonl

`supporting_doc_ids`: corpus ids in the order of the dataset's facts (MuSiQue's decomposition: hop order), no id twice;
where the dataset has them, `sub_queries`, `sub_answers`, `hops` (MuSiQue's question_decomposition; 2Wiki's evidence
triples, whose objects are the sub-answers; HotpotQA: `hops` alone, its supporting articles). A fact matches by its
article's title, then by its text (a HotpotQA or 2Wiki sentence, a MuSiQue paragraph) inside that title's passages
(wiki-18 cuts an article into 100-word passages), both normalised (one kind of quote and dash, NFKC, single spaces,
case folded): the text's sentences are looked up in the title's passages joined in corpus order; when those found hold
more than half of its characters, the passage holding the most of them is the match (a sentence straddling two passages
counts for each the characters it has there; the earlier passage on a tie). Nothing is guessed: a row is written only
when all its facts matched (--partial: when one did); each fact not matched goes to <out>.unmatched.jsonl with the
reason. A row that holds supporting_doc_ids is left as it is (--overwrite: found again, replaced where found). The
corpus is read once, keeping only the passages of the titles the rows need.

FlashRAG's metadata layouts (the hub's `datasets` layout, a dict of lists; the original files' lists are read too):
- hotpotqa: supporting_facts {title: [...], sent_id: [...]}, context {title: [...], sentences: [[...], ...]}
- 2wikimultihopqa: supporting_facts as above, context {title, content}, evidences {fact, relation, entity}
- musique: answerable, question_decomposition [{id, question, answer, paragraph_support_idx, support_paragraph: {idx,
  title, paragraph_text, is_supporting}}]; no `paragraphs` (the original files' are read through paragraph_support_idx)
Read in: huggingface.co/datasets/RUC-NLPIR/FlashRAG_datasets, the features in the cards of huggingface.co/datasets/
hotpotqa/hotpot_qa and huggingface.co/datasets/ohjoonhee/2WikiMultihopQA, MuSiQue's own rows as
oyar99/RAG-Scaling-for-QA src/datasets/musique/README.md shows them, and public code that reads FlashRAG's files (the
metadata nesting, 2Wiki's `content` and `evidences`, MuSiQue's support_paragraph).
"""

import argparse
import re
import unicodedata
from collections import Counter
from itertools import accumulate
from pathlib import Path

from common import runs
from common.data import DataError, iter_jsonl, write_jsonl
from common.retrieval import split_contents

SAME = str.maketrans("“”„‘’`´–—−", "\"\"\"''''---")  # typographic quotes and dashes as the ASCII ones


def norm(text):
    """How titles and texts are compared: one kind of quote and dash, Unicode NFKC, single spaces, case folded."""
    return " ".join(unicodedata.normalize("NFKC", str(text).translate(SAME)).split()).casefold()


def columns(value, keys, where, field):
    """A dict of lists {key: [...]} (FlashRAG's layout) or a list of [...] (the original files'): a list of tuples."""
    if isinstance(value, dict) and all(isinstance(value.get(k), list) for k in keys):
        if len({len(value[k]) for k in keys}) == 1:
            return list(zip(*(value[k] for k in keys)))
        raise DataError(f"{where}: metadata {field!r}: the lists {', '.join(keys)} differ in length")
    if isinstance(value, list) and all(isinstance(v, (list, tuple)) and len(v) == len(keys) for v in value):
        return [tuple(v) for v in value]
    raise DataError(f"{where}: metadata {field!r} is neither {{{', '.join(keys)}: [...]}} nor a list of {keys}")


def facts_of(meta, where):
    """(dataset, [(title, text)], the hop fields) of a row's metadata; dataset None when it has no supporting facts. A
    fact whose text the row does not hold has text None."""
    if "question_decomposition" in meta or "paragraphs" in meta:
        paragraphs = meta.get("paragraphs") or []
        by_idx = {p.get("idx", i): p for i, p in enumerate(paragraphs) if isinstance(p, dict)}
        steps = meta.get("question_decomposition") or []
        if not all(isinstance(s, dict) and isinstance(s.get("question"), str) and "answer" in s for s in steps):
            raise DataError(f"{where}: metadata 'question_decomposition' must be a list of {{question, answer, ...}}")
        if not steps:
            supporting = [p for p in by_idx.values() if p.get("is_supporting")]
            return "musique", [(p.get("title"), p.get("paragraph_text")) for p in supporting], {}
        support = [s.get("support_paragraph") or by_idx.get(s.get("paragraph_support_idx")) or {} for s in steps]
        hops = {"sub_queries": [s["question"] for s in steps], "sub_answers": [s.get("answer") for s in steps]}
        return "musique", [(p.get("title"), p.get("paragraph_text")) for p in support], hops | {"hops": len(steps)}
    if "supporting_facts" not in meta:
        return None, [], {}
    context = meta.get("context") or []
    key = "content" if isinstance(context, dict) and "content" in context else "sentences"
    sentences = dict(columns(context, ("title", key), where, "context"))
    facts = []
    for title, sent_id in columns(meta["supporting_facts"], ("title", "sent_id"), where, "supporting_facts"):
        held = sentences.get(title) or []
        facts.append((title, held[sent_id] if isinstance(sent_id, int) and 0 <= sent_id < len(held) else None))
    triples = (
        columns(meta["evidences"], ("fact", "relation", "entity"), where, "evidences") if "evidences" in meta else []
    )
    # HotpotQA's hops: its question's supporting articles (two for every bridge and comparison question)
    hops = {"sub_answers": [o for _, _, o in triples], "hops": len(triples)} if triples else {}
    hops = hops or {"hops": len(dict.fromkeys(title for title, _ in facts))}
    return ("2wikimultihopqa" if key == "content" or "evidences" in meta else "hotpotqa"), facts, hops


def read_passages(path, titles):
    """normalised title -> (ids, normalised texts, the texts joined by spaces, where each starts in the join), in
    corpus order, for `titles` only: one pass over the corpus."""
    found = {}
    rows = iter_jsonl(path, required=("id", "contents"))
    for lineno, row in runs.progress(rows, desc="corpus", unit=" passages", unit_scale=True):
        if not isinstance(row["contents"], str):
            raise DataError(f"{path}:{lineno}: field 'contents' must be a string")
        title, text = split_contents(row["contents"])
        if (key := norm(title)) in titles:
            found.setdefault(key, []).append((str(row["id"]), norm(text)))
    for key, passages in found.items():
        texts = [text for _, text in passages]
        starts = [0, *accumulate(len(text) + 1 for text in texts)][:-1]
        found[key] = ([i for i, _ in passages], texts, " ".join(texts), starts)
    return found


def locate(text, article):
    """The id of the passage of `article` (read_passages) that holds the most of `text`'s sentences found in the
    article, when the sentences found hold more than half of its characters; else None."""
    ids, texts, joined, starts = article
    units = [u for u in re.split(r"(?<=[.!?]) ", norm(text)) if u]
    held = [0] * len(texts)
    for unit in units:
        if (at := joined.find(unit)) >= 0:  # its first place in the article
            for k, (start, passage) in enumerate(zip(starts, texts)):
                held[k] += max(0, min(at + len(unit), start + len(passage)) - max(at, start))
    best = held.index(max(held))  # the earlier passage on a tie
    return ids[best] if 2 * sum(held) > sum(len(u) for u in units) else None


def rows_of(files):
    """(where, row) of every row of `files`, in order: where is "file:line"."""
    for path in files:
        for lineno, row in iter_jsonl(path, required=("id", "question")):
            if not isinstance(row.get("metadata", {}), dict):
                raise DataError(f"{path}:{lineno}: field 'metadata' must be an object")
            yield f"{path}:{lineno}", row


def find(row_id, dataset, facts, passages):
    """The passage ids of a row's facts (None: not matched) and a line for each fact not matched."""
    ids, unmatched = [], []
    for title, text in facts:
        article = passages.get(norm(title)) if title and text else None
        ids.append(locate(text, article) if article else None)
        if ids[-1] is None:
            why = "text not found in the title's passages" if article else "no passage of that title in the corpus"
            why = why if title and text else "the row holds no text for it"
            unmatched.append({"id": row_id, "dataset": dataset, "title": title, "text": text, "why": why})
    return ids, unmatched


def main(argv=None):
    about = "each question's supporting passages in a FlashRAG corpus, into the rows' metadata (data/README.md)"
    parser = argparse.ArgumentParser(prog="python -m common.evidence", description=about)
    parser.add_argument("files", nargs="+", help="FlashRAG QA files, e.g. flashrag/hotpotqa/train.jsonl")
    parser.add_argument("--corpus", required=True, help="the FlashRAG corpus, e.g. wiki18_100w.jsonl")
    parser.add_argument("--out", required=True, help="the rows of all files, with their evidence (.jsonl)")
    parser.add_argument("--overwrite", action="store_true", help="find again the rows' supporting_doc_ids")
    parser.add_argument("--partial", action="store_true", help="write a row where only some facts matched")
    args = parser.parse_args(argv)
    plans = []  # per row: (dataset, facts, hop fields); dataset "kept" or None: the row is left as it is
    for where, row in rows_of(args.files):
        keep = "supporting_doc_ids" in row.get("metadata", {}) and not args.overwrite
        plans.append(("kept", [], {}) if keep else facts_of(row.get("metadata", {}), where))
    titles = {norm(title) for _, facts, _ in plans for title, text in facts if title and text}
    passages = read_passages(args.corpus, titles)
    found, unmatched, counts = [], [], Counter()
    for (dataset, facts, hops), (_, row) in zip(plans, rows_of(args.files)):
        ids, missed = find(row["id"], dataset, facts, passages)
        unmatched += missed
        counts.update({(dataset, "rows"): 1, (dataset, "facts"): len(facts), (dataset, "matched"): len(facts)})
        counts.update({(dataset, "matched"): -len(missed), (dataset, "full"): int(bool(facts) and not missed)})
        write = dataset not in (None, "kept") and len(missed) < len(facts) and (args.partial or not missed)
        found.append({"supporting_doc_ids": list(dict.fromkeys(i for i in ids if i))} | hops if write else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = (
        row | {"metadata": row.get("metadata", {}) | new} if new else row
        for (_, row), new in zip(rows_of(args.files), found)
    )
    write_jsonl(args.out, rows)
    write_jsonl(side := Path(args.out).with_suffix(".unmatched.jsonl"), unmatched)
    rate = lambda name, a, b: f"{counts[name, a]}/{counts[name, b]} ({counts[name, a] / max(counts[name, b], 1):.1%})"
    for name in sorted({d for d, _ in counts} - {None, "kept"}):
        print(
            f"{name}: facts matched {rate(name, 'matched', 'facts')}, rows fully matched {rate(name, 'full', 'rows')}"
        )
    kept, other = counts["kept", "rows"], counts[None, "rows"]
    print(f"left as they are: {kept} rows that held supporting_doc_ids, {other} rows with no supporting facts")
    print(f"wrote {len(found)} rows, {len(found) - found.count(None)} with new evidence, to {args.out}")
    print(f"{len(unmatched)} facts not matched: {side}")


if __name__ == "__main__":
    from common.evidence import main as command_line  # this module's errors as common.data's, which run_main knows

    runs.run_main(command_line)
