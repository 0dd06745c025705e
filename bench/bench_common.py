"""Speed of the shared plumbing: index build and batched search, batched vs one-by-one generation.

    python bench/bench_common.py                 # about a minute on 2 CPU cores; prints a markdown table

Figures go to docs/benchmarks.md with the machine they were measured on. Nothing touches the network.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from common.data import load_qa  # noqa: E402
from common.llm import generate  # noqa: E402
from common.retrieval import BM25Retriever, DenseRetriever, load_corpus, make_encoder  # noqa: E402
from common.toy import DEFAULT_WORLD  # noqa: E402
from common.toy.lm import load_toy_lm  # noqa: E402


def timed(fn, repeat=3):
    """(best wall seconds over `repeat` runs, last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def synthetic_corpus(docs, n):
    """n passages made by recombining the toy passages' sentences (a larger corpus of the same kind)."""
    sentences = [s.strip() + " ." for d in docs for s in d["text"].split(" .") if s.strip()]
    return [
        {
            "id": str(i),
            "contents": f'"p{i}"\n' + " ".join(sentences[(i * 7 + j * 13) % len(sentences)] for j in range(3)),
        }
        for i in range(n)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default=str(DEFAULT_WORLD))
    parser.add_argument("--big", type=int, default=20_000, help="passages of the synthetic corpus")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per generation batch")
    args = parser.parse_args()
    rows = []
    docs = load_corpus(Path(args.world) / "corpus.jsonl")
    questions = [r["question"] for r in load_qa(Path(args.world) / "test.jsonl")]
    big = synthetic_corpus(docs, args.big)
    for name, corpus in [(f"toy corpus ({len(docs)} passages)", docs), (f"synthetic ({len(big)} passages)", big)]:
        build_s, dense = timed(lambda: DenseRetriever.build(corpus, make_encoder("tfidf")), 1)
        search_s, _ = timed(lambda: dense.search(questions, 5))
        rows.append(
            (
                f"TF-IDF + faiss Flat, {name}",
                f"build {build_s:.2f} s",
                f"{len(questions)} queries top-5: {search_s:.3f} s",
            )
        )
        build_s, bm25 = timed(lambda: BM25Retriever.build(corpus), 1)
        search_s, _ = timed(lambda: bm25.search(questions, 5))
        rows.append(
            (f"BM25 (bm25s), {name}", f"build {build_s:.2f} s", f"{len(questions)} queries top-5: {search_s:.3f} s")
        )
    model, tokenizer = load_toy_lm("toy-lm")
    model.eval()
    prompts = [f"question : {q} output :" for q in questions[: args.prompts]]
    batched_s, batched = timed(lambda: generate(model, tokenizer, prompts, 8, do_sample=False))
    single_s, single = timed(lambda: [generate(model, tokenizer, [p], 8, do_sample=False) for p in prompts], 1)
    assert batched.token_ids == [g.token_ids[0] for g in single], "batched greedy differs from one-by-one"
    rows.append(
        (
            f"greedy generation, toy-lm, {len(prompts)} prompts x 8 tokens",
            f"one batched call {batched_s:.3f} s",
            f"one by one {single_s:.3f} s ({single_s / batched_s:.1f}x slower)",
        )
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print("| what | time | time |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
