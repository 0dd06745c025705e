"""Building retriever folders at any scale: the command line of `python -m common.retrieval` (build, search).

A dense build encodes the corpus in shards of --shard_size passages, split over the processes of an accelerate
launch (shard i goes to process i mod N), each shard written to <out>/embeddings/ as a float16 .npy file the moment
it is done (atomically: a file there is a finished shard). Started again after an interruption, the build encodes
only the shards not yet written. The main process then memory-maps the shards, trains the faiss index on a sample of
the vectors when it needs training (IVF, PQ), adds every vector in corpus order and saves the folder; the processes
only encode. The same shards give the same index whatever the process count.

    python -m common.retrieval build --corpus wiki18_100w.jsonl --encoder intfloat/e5-base-v2 --out indexes/e5
    accelerate launch --num_processes 8 -m common.retrieval build --corpus wiki18_100w.jsonl \\
        --encoder intfloat/e5-base-v2 --index_factory IVF65536,PQ64 --search_params nprobe=128 --out indexes/e5_pq

Index factories and their memory for N passages of dimension d (bench/index_types.py; recall in docs/benchmarks.md):
Flat, exact, 4·N·d bytes (wiki-18 with E5-base: 21M x 768, 60 GiB); HNSW32 about 270·N bytes of links on top;
IVF<k>,Flat as Flat, with faster search; IVF<k>,PQ<m> about (m + 8)·N bytes (PQ64: 1.4 GiB for wiki-18).
--search_params sets faiss's search-time parameters (nprobe=..., efSearch=...), stored with the folder and applied
when it is loaded.
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from common import runs
from common.retrieval import (
    BM25Retriever,
    DenseRetriever,
    EncoderLoadError,
    TfidfEncoder,
    atomic_write,
    fit_tfidf,
    load_retriever,
    make_encoder,
    resolve_corpus,
)


def save_npy(path, array):
    """np.save to exactly `path` (np.save given a name would append .npy to a temporary name)."""
    with open(path, "wb") as f:
        np.save(f, array)


def build_sharded(
    corpus, encoder, out, index_factory="Flat", search_params="", shard_size=100_000, train_size=100_000, keep=False
):
    """Encode `corpus` in shards across this launch's processes into out/embeddings/, then (main process) build the
    faiss index from the memory-mapped shards and save the retriever folder `out`. Returns the retriever (main
    process) or None. Shards of an earlier, interrupted build with the same corpus, encoder and shard size are kept;
    once the folder is saved they are deleted unless `keep` (to build other index types without encoding again)."""
    import faiss
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # gloo on CPU: `accelerate launch --multi_gpu ...`
    corpus_path, docs = resolve_corpus(corpus)
    texts = [d["contents"] for d in docs]
    encoder = fit_tfidf(encoder, texts) if isinstance(encoder, TfidfEncoder) else encoder
    shards, n_shards = Path(out) / "embeddings", -(-len(texts) // shard_size)
    spec = {k: v for k, v in encoder.spec().items() if k not in ("vocab", "idf")}  # TF-IDF's follow from the corpus
    plan = {"corpus": corpus_path, "num_docs": len(texts), "encoder": spec, "shard_size": shard_size}
    if state.is_main_process:
        shards.mkdir(parents=True, exist_ok=True)
        if (shards / "plan.json").is_file() and json.loads((shards / "plan.json").read_text()) != plan:
            raise EncoderLoadError(f"{shards} holds the shards of another build (plan.json): remove it or use --out")
        atomic_write(shards / "plan.json", lambda p: Path(p).write_text(json.dumps(plan)))
    state.wait_for_everyone()
    path = lambda i: shards / f"shard_{i:05d}.npy"
    todo = [i for i in range(state.process_index, n_shards, state.num_processes) if not path(i).is_file()]
    for i in runs.progress(todo, desc=f"encode (process {state.process_index})", disable=not todo):
        vectors = encoder.encode(texts[i * shard_size : (i + 1) * shard_size]).astype(np.float16)
        atomic_write(path(i), lambda p: save_npy(p, vectors))  # called at once
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    parts = [np.load(path(i), mmap_mode="r") for i in range(n_shards)]  # float16 on disk, read as needed
    index = faiss.index_factory(parts[0].shape[1], index_factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        rows = np.sort(np.random.default_rng(0).choice(len(texts), min(train_size, len(texts)), replace=False))
        index.train(np.stack([parts[r // shard_size][r % shard_size] for r in rows]).astype(np.float32))
    for part in runs.progress(parts, desc="index", disable=n_shards < 2):
        for start in range(0, len(part), 65_536):
            index.add(np.asarray(part[start : start + 65_536], dtype=np.float32))
    retriever = DenseRetriever(index, docs, encoder, corpus_path, index_factory, search_params)
    retriever.save(out)
    if not keep:
        shutil.rmtree(shards)
    return retriever


def parse_args(argv=None):
    """Command line: `build` an index folder, or `search` one."""
    parser = argparse.ArgumentParser(prog="python -m common.retrieval", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="encode a corpus jsonl and save a retriever folder")
    build.add_argument("--corpus", required=True, help="FlashRAG corpus jsonl ({'id', 'contents'} per line)")
    build.add_argument("--encoder", required=True, help="tfidf, bm25, a hub id or a local folder (e5/bge/contriever)")
    build.add_argument("--stemmer", default=None, help="BM25 only: PyStemmer language, e.g. english (not installed "
                       "with this project: pip install PyStemmer); default: no stemming")  # fmt: skip
    build.add_argument("--out", required=True, help="folder to write the retriever to")
    build.add_argument(
        "--index_factory", default="Flat", help="faiss factory: Flat, HNSW32, IVF4096,Flat, IVF65536,PQ64"
    )
    build.add_argument("--search_params", default="", help="faiss search parameters, e.g. nprobe=64 or efSearch=128")
    build.add_argument("--train_size", type=int, default=100_000, help="vectors sampled to train an IVF/PQ index")
    build.add_argument("--shard_size", type=int, default=100_000, help="passages per embeddings shard (resume unit)")
    build.add_argument("--keep_embeddings", action="store_true", help="keep <out>/embeddings/ after the build")
    build.add_argument("--batch_size", type=int, default=64, help="encoder batch size (transformers encoders)")
    build.add_argument("--max_length", type=int, default=512, help="encoder max tokens (transformers encoders)")
    build.add_argument("--device", default=None, help="encoder device (default: this process's accelerator)")
    build.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="encoder weights' dtype (default: bfloat16 on a GPU, float32 on CPU)")  # fmt: skip
    search = sub.add_parser("search", help="search a saved retriever folder; prints one JSON line per query")
    search.add_argument("--index", required=True, help="retriever folder written by `build` (dense or BM25)")
    search.add_argument("--query", required=True, action="append", help="query text (repeat for several)")
    search.add_argument("-k", type=int, default=5, help="passages per query")
    search.add_argument("--corpus", default=None, help="corpus jsonl, if it moved since the build")
    return parser.parse_args(argv)


def main(argv=None):
    """Run the command line."""
    args = parse_args(argv)
    if args.command == "build" and args.encoder == "bm25":
        retriever = BM25Retriever.build(args.corpus, stemmer=args.stemmer)
        retriever.save(args.out)
        print(f"indexed {len(retriever.corpus)} passages (bm25, stemmer {args.stemmer}) into {args.out}")
    elif args.command == "build":
        if args.stemmer:
            raise EncoderLoadError(f"--stemmer is for --encoder bm25, not {args.encoder!r}")
        if args.encoder == "tfidf":
            encoder = make_encoder("tfidf")
        else:
            import torch
            from accelerate import PartialState

            device = args.device or str(PartialState(cpu=not torch.cuda.is_available()).device)  # a GPU a process
            encoder = make_encoder(args.encoder, batch_size=args.batch_size, max_length=args.max_length, device=device,
                                   dtype=args.dtype)  # fmt: skip
        retriever = build_sharded(args.corpus, encoder, args.out, args.index_factory, args.search_params,
                                  args.shard_size, args.train_size, args.keep_embeddings)  # fmt: skip
        if retriever is not None:
            print(f"indexed {retriever.index.ntotal} passages ({args.encoder}, {args.index_factory}) into {args.out}")
    else:
        retriever = load_retriever(args.index, corpus=args.corpus)
        for query, hits in zip(args.query, retriever.search(args.query, args.k)):
            print(json.dumps({"query": query, "hits": hits}, ensure_ascii=False))
