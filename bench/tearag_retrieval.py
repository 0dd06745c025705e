"""TeaRAG's retrieval variants (Table 7) side by side on a toy world: evidence recall, distractors, tokens.

    python bench/tearag_retrieval.py [--data_dir data/toy] [--split test] [--k_f 5]

For every step of every question with a decomposition (metadata sub_queries, sub_answers, supporting_doc_ids), the
retrieval system runs on the step's sub-query with the step's head entity as key entity (what a model that decomposes
perfectly would ask: the iterative TeaRAG-* rows), and once on the raw question with its first entity (one retrieval
round: the Single-* rows). Per retrieval mode it prints:
- step recall: the share of steps whose fact is in the context (a chunk of the step's supporting passage, or a
  triplet of that passage that holds the step's answer);
- question recall (single round only): the share of all the question's step facts found by the one retrieval;
- passage recall (single round only): the share of the question's supporting passages that a context item comes
  from (a chunk of it or a triplet extracted from it: `evidence_recall` of tearag.py's evaluation);
- distractor share: the share of context items from a decoy passage (metadata distractor_doc_ids);
- items and tokens per retrieval (the toy model's tokenizer over the evidence block, CpR in the paper).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tearag as T
from common import runs
from common.data import load_split
from common.toy import load_world
from common.toy.lm import build_tokenizer


def holds(item, doc, head, answer):
    """Whether a context item states the step's fact: its passage, or a triplet of it with the head and answer."""
    if item["kind"] == "chunk":
        return item["id"] == str(doc)
    ends = {T.norm_name(item["head"]), T.norm_name(item["tail"])}
    return item["doc_id"] == str(doc) and {T.norm_name(head), T.norm_name(answer)} <= ends


def steps_of(row):
    """[(sub-query, head entity, answer, supporting doc)] of a question, or [] without a full decomposition."""
    m = row["metadata"]
    subs, answers, docs = m.get("sub_queries") or [], m.get("sub_answers") or [], m.get("supporting_doc_ids") or []
    if not subs or not len(subs) == len(answers) == len(docs):
        return []
    heads = m["entities"][:2] if m["type"] in ("comparison", "yes_no") else m["entities"][:-1]
    return list(zip(subs, heads, answers, docs))


def measure(system, tokenizer, rows, mode):
    """The figures of one retrieval mode, iterative (oracle sub-queries) and single-round (raw question)."""
    system.args.retrieval = mode
    rows = [r for r in rows if steps_of(r)]
    steps = [(r, s) for r in rows for s in steps_of(r)]
    iterative = system.retrieve([s[0] for _, s in steps], [[s[1]] for _, s in steps])
    single = system.retrieve([r["question"] for r in rows], [[steps_of(r)[0][1]] for r in rows])
    decoy = lambda r, ctx: [it["doc_id"] in set(r["metadata"]["distractor_doc_ids"]) for it in ctx]
    tokens = lambda ctx: len(tokenizer(T.reference_block(ctx), add_special_tokens=False)["input_ids"])
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    found = [any(holds(it, s[3], s[1], s[2]) for it in ctx) for (_, s), ctx in zip(steps, iterative)]
    covered = [
        mean([any(holds(it, s[3], s[1], s[2]) for it in ctx) for s in steps_of(r)]) for r, ctx in zip(rows, single)
    ]
    sources = lambda r, ctx: {str(d) for d in r["metadata"]["supporting_doc_ids"]} & {it["doc_id"] for it in ctx}
    passages = [len(sources(r, ctx)) / len(r["metadata"]["supporting_doc_ids"]) for r, ctx in zip(rows, single)]
    return {
        "step recall": mean(found),
        "distractor share": mean([x for (r, _), ctx in zip(steps, iterative) for x in decoy(r, ctx)]),
        "items": mean([len(ctx) for ctx in iterative]),
        "tokens": mean([tokens(ctx) for ctx in iterative]),
        "single: question recall": mean(covered),
        "single: passage recall": mean(passages),
        "single: tokens": mean([tokens(ctx) for ctx in single]),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", default="data/toy")
    parser.add_argument("--split", default="test")
    parser.add_argument("--k_f", type=int, default=5)
    cli = parser.parse_args()
    (args,) = runs.flag_parser(T.Args).parse_args_into_dataclasses(
        args=["--data_dir", cli.data_dir, "--k_f", str(cli.k_f)]
    )
    system = T.RetrievalSystem(T.apply_preset(args))
    tokenizer = build_tokenizer(load_world(cli.data_dir), (T.REF_OPEN, T.REF_CLOSE))
    rows = load_split(cli.data_dir, cli.split)
    names = {"semantic": "TeaRAG-S (chunks)", "graph": "TeaRAG-G (triplets)", "concat": "TeaRAG-Con (5 + 5)",
             "ppr": "TeaRAG (KAG + PPR)"}  # fmt: skip
    results = {names[m]: measure(system, tokenizer, rows, m) for m in names}
    columns = list(next(iter(results.values())))
    n = sum(bool(steps_of(r)) for r in rows)
    print(f"{cli.data_dir} {cli.split}: {n} questions with a decomposition, k_f = {cli.k_f}")
    print("| retrieval | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 1) + "|")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3f}" if r[c] <= 1 else f"{r[c]:.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
