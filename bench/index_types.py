"""faiss index types for a wiki-18-sized dense index: recall against exact search, bytes per passage, build and search
time (what `python -m common.retrieval build --index_factory F --search_params P` builds from the encoded shards).

    python bench/index_types.py                      # 100,000 synthetic vectors of dimension 768; about 10 minutes
    python bench/index_types.py --n 20000 --dim 64   # quick
    python bench/index_types.py --vectors indexes/e5/embeddings/shard_00000.npy   # your corpus's own vectors

Bytes per passage is what each added vector costs in the serialised index (codes, links, ids), fixed MiB what the
trained empty index holds (centroids, codebooks); "21M passages" is fixed + 21M x bytes per passage, wiki-18's size
(the doc ids and the corpus text are apart). Recall@10 is the share of the exact top-10 found, queries being
held-out vectors of the same set. The synthetic vectors are unit vectors around 1,000 random centres:
well-separated clusters, which IVF finds easily, so recall on real embeddings can be lower; choose a factory on your
own corpus's vectors (`build --keep_embeddings` keeps them as float16 shards).
"""

import argparse
import time

import faiss
import numpy as np

FACTORIES = [  # (factory, search parameters)
    ("Flat", ""),
    ("HNSW32", "efSearch=64"),
    ("HNSW32", "efSearch=256"),
    ("IVF{k},Flat", "nprobe=16"),
    ("IVF{k},Flat", "nprobe=64"),
    ("IVF{k},PQ{m}", "nprobe=64"),
    ("OPQ{m},IVF{k},PQ{m}", "nprobe=64"),
]


def clustered(n, dim, clusters, rng):
    """n unit vectors around `clusters` random centres (a crude stand-in for passage embeddings), float32."""
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    x = centres[rng.integers(clusters, size=n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="indexed vectors")
    parser.add_argument("--dim", type=int, default=768, help="dimension (E5-base, Contriever: 768)")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--lists", type=int, default=0, help="IVF lists (default: 4 sqrt(n))")
    parser.add_argument("--pq", type=int, default=0, help="PQ sub-quantisers (default: dim / 12, a divisor of dim)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vectors", default="", help="a .npy of real vectors (first n + queries rows) instead")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.vectors:
        data = np.load(args.vectors, mmap_mode="r")[: args.n + args.queries].astype(np.float32)
        args.n, args.dim = len(data) - args.queries, data.shape[1]
    else:
        data = clustered(args.n + args.queries, args.dim, 1000, rng)
    base, queries = data[: args.n], data[args.n :]
    k_lists = args.lists or int(4 * args.n**0.5)
    m = args.pq or max(d for d in range(1, args.dim // 12 + 1) if args.dim % d == 0)
    exact = None
    print(
        f"n={args.n} dim={args.dim} queries={args.queries} k={args.k} lists={k_lists} m={m} faiss {faiss.__version__}"
    )
    print("| index | search params | recall@10 | bytes / passage | fixed MiB | 21M passages | build s | ms / query |")
    print("|---|---|---|---|---|---|---|---|")
    for template, params in FACTORIES:
        factory = template.format(k=k_lists, m=m)
        index = faiss.index_factory(args.dim, factory, faiss.METRIC_INNER_PRODUCT)
        start = time.perf_counter()
        if not index.is_trained:
            index.train(base[rng.choice(args.n, min(args.n, 100_000), replace=False)])
        fixed = faiss.serialize_index(index).size  # centroids, codebooks: paid once, whatever the corpus size
        index.add(base)
        build = time.perf_counter() - start
        if params:
            faiss.ParameterSpace().set_index_parameters(index, params)
        start = time.perf_counter()
        _, ids = index.search(queries, args.k)
        per_query = (time.perf_counter() - start) / args.queries * 1000
        exact = ids if exact is None else exact
        recall = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(ids, exact)])
        size = (faiss.serialize_index(index).size - fixed) / args.n
        print(f"| {factory} | {params or '-'} | {recall:.3f} | {size:.0f} | {fixed / 2**20:.1f} | "
              f"{(fixed + size * 21e6) / 2**30:.1f} GiB | {build:.1f} | {per_query:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
