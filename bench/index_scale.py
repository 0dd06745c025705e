"""A dense index over a synthetic corpus of up to millions of passages through the project's own build command:
encode and index throughput, search throughput, recall of an IVF index against exact search, index sizes, peak GPU
memory.

    python bench/index_scale.py                        # 500,000 passages, E5-base-v2's shape, one GPU (~3 min: below)
    python bench/index_scale.py --passages 1000000     # 1M passages (docs/benchmarks.md's GPU figures)
    python bench/index_scale.py --passages 2000 --encoder_shape tiny --vocab_words 20000 --ivf_factory IVF16,Flat \
        --search_params nprobe=4                       # the same code path on CPU, in seconds

The default is 500,000 passages, not 1M, to fit a few minutes on one GPU: the build tokenizes on the CPU and
then encodes on the GPU, batch after batch (one core of a 2-core CPU machine tokenizes about 1,600 of these passages
a second); on one H200, 1M passages took 218 s to encode (docs/benchmarks.md).

Offline, in one command, under --workdir (default a temporary folder; corpus, shards and indexes are deleted at the
end unless --keep):
1. corpus: --passages FlashRAG passages ({"id", "contents": '"title"\\ntext'}) of 100 words (wiki-18's 100-word
   chunks) and a 1-3 word title, the words drawn with a Zipf law (p ~ 1/(rank + 2.7)) from a seeded vocabulary of
   --vocab_words made-up words (shorter words are more frequent), seeded.
2. encoder: a WordPiece tokenizer (30,522 pieces, BERT's count) trained offline with `tokenizers` on 10,000 of
   these passages, so that rare words split into pieces as in real text (132 tokens per passage with the E5 prefix
   on 250,000 passages, printed; wiki-18 passages are 130-150), and a BERT with random weights in E5-base-v2's shape
   (hidden 768, 12 layers, 12 heads, intermediate 3072, 512 positions), saved in float32 as the hub's E5 is, to a
   folder named e5-base-v2-random: the encoder loader's E5 preset ("query: " / "passage: " prefixes, mean pooling)
   and its default dtype (bfloat16 on a GPU, float32 on CPU) apply as to intfloat/e5-base-v2.
3. build: `python -m common.retrieval build` as a subprocess (one GPU: one process), first Flat (exact) with
   --keep_embeddings, then --ivf_factory with --search_params from the same float16 shards (moved to its folder, so
   it encodes nothing; deleted after). Timed from the files the build writes: startup (imports, corpus load, model
   load) until embeddings/plan.json, encoding until the last shard, index building (train, add, write) until
   retriever.json. Tokens/s is passages/s times the mean tokens per passage (non-padding, at the build's max
   length, 512) of a 10,000-passage sample. Peak GPU memory of a build is the device's used memory (polled every
   0.1 s) above what it was before the build: the build process's CUDA context and allocator cache included.
4. search: both folders loaded with common.retrieval.load_retriever (the corpus read once), then
   DenseRetriever.search (encode the queries, faiss search, hits) of --queries queries, top-10, in batches of 64 and
   1024; the query encoding and faiss search are also timed alone. Queries are 8 words of a random passage each.
   Recall@10 of the IVF index is the share of Flat's top-10 (same query vectors) it returns.
One JSON line per stage on stdout (the build's own output goes to stderr); --json PATH gets them all, rewritten
after each stage. Figures go to docs/benchmarks.md with the machine they were measured on.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from operator import itemgetter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import numpy as np  # noqa: E402

from common.retrieval import load_corpus, load_retriever  # noqa: E402

SHAPES = {  # BertConfig fields: E5-base-v2's published config, and a tiny one for CPU tests
    "e5-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
}
WORDS_PER_PASSAGE = 100  # wiki-18 (wiki18_100w): 100-word chunks
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--passages",
        type=int,
        default=500_000,
        help="corpus size in passages (1,000,000 on one H200: docs/benchmarks.md)",
    )
    parser.add_argument("--encoder_shape", default="e5-base", choices=sorted(SHAPES))
    parser.add_argument("--vocab_words", type=int, default=200_000, help="made-up words in the corpus vocabulary")
    parser.add_argument("--ivf_factory", default="IVF4096,Flat", help="the approximate index's faiss factory")
    parser.add_argument("--search_params", default="nprobe=64", help="its faiss search parameters")
    parser.add_argument("--batch_size", type=int, default=256, help="the build's encoder batch size")
    parser.add_argument("--dtype", default=None, help="the build's --dtype (default: its own, bf16 on a GPU)")
    parser.add_argument("--queries", type=int, default=2048, help="queries per search batch size")
    parser.add_argument("--search_batches", default="64,1024", help="queries per search call")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where corpus, encoder and indexes go (default: temporary)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir's corpus, encoder and indexes")
    parser.add_argument("--json", default=None, help="also write every stage's record to this file")
    return parser.parse_args(argv)


def make_vocabulary(n, rng):
    """n distinct made-up lowercase words of 1-4 syllables, shortest first (the frequent ranks of the Zipf law)."""
    onsets = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "br", "tr", "st"]
    syllables = sorted({o + v + c for o in onsets for v in ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
                        for c in ["", "n", "r", "s", "l", "m"]})  # fmt: skip
    words, seen = [], set()
    while len(words) < n:
        counts = rng.choice([1, 2, 3, 4], size=2 * n, p=[0.15, 0.4, 0.3, 0.15])
        parts = np.asarray(syllables)[rng.integers(len(syllables), size=(2 * n, 4))].tolist()
        for part, count in zip(parts, counts):
            word = "".join(part[:count])
            if word not in seen and len(words) < n:
                seen.add(word)
                words.append(word)
    return sorted(words, key=len)  # stable: ties keep their seeded order


def write_corpus(path, passages, vocab_words, seed, queries, chunk=50_000):
    """Write the synthetic FlashRAG corpus; returns (bytes written, `queries` query strings of 8 passage words)."""
    rng = np.random.default_rng(seed)
    vocab = make_vocabulary(vocab_words, rng)
    p = 1.0 / (np.arange(len(vocab)) + 2.7)  # Zipf-Mandelbrot law of word frequency
    cdf = np.cumsum(p) / p.sum()
    table = np.minimum(np.searchsorted(cdf, (np.arange(1 << 24) + 0.5) / (1 << 24)), len(vocab) - 1).astype(np.int32)
    query_rows = np.sort(rng.choice(passages, size=min(queries, passages), replace=False))
    query_texts, written = [], 0
    with open(path, "w") as f:
        for start in range(0, passages, chunk):
            size = min(chunk, passages - start)
            ids = table[rng.integers(1 << 24, size=(size, WORDS_PER_PASSAGE + 3))]  # 100 words, up to 3 of title
            title_len = rng.integers(1, 4, size=size)
            lines = []
            for i, (row, t) in enumerate(zip(ids.tolist(), title_len.tolist())):
                words = itemgetter(*row)(vocab)
                title, text = " ".join(words[:t]), " ".join(words[3:])
                lines.append(f'{{"id": "{start + i}", "contents": "\\"{title}\\"\\n{text}"}}\n')
            for r in query_rows[(query_rows >= start) & (query_rows < start + size)]:
                words = itemgetter(*ids[r - start, 3:].tolist())(vocab)
                query_texts.append(" ".join(words[j] for j in rng.choice(WORDS_PER_PASSAGE, size=8, replace=False)))
            written += f.write("".join(lines))
    rng.shuffle(query_texts)
    return written, [query_texts[i % len(query_texts)] for i in range(queries)]


def sample_passages(path, n):
    """The contents of the first n passages of a corpus jsonl."""
    texts = []
    with open(path) as f:
        for line in f:
            if len(texts) == n:
                break
            texts.append(json.loads(line)["contents"])
    return texts


def make_encoder_folder(folder, corpus_path, shape, seed):
    """A WordPiece tokenizer trained on the corpus's first 10,000 passages and a random BERT of `shape`, saved as a
    transformers folder; returns (parameters, tokenizer vocabulary size)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=30_522, special_tokens=SPECIALS, show_progress=False)
    prefixes = ['query: passage: "'] * 100  # E5's prefixes and the title quotes become tokens of their own
    tokenizer.train_from_iterator(sample_passages(corpus_path, 10_000) + prefixes, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer.decoder = decoders.WordPiece()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=512,
    )  # fmt: skip
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=512, **SHAPES[shape])
    model = BertModel(config)  # with BERT's pooler, as E5's checkpoint (unused: E5 mean-pools the last states)
    model.save_pretrained(folder)  # float32, as intfloat/e5-base-v2 is published
    wrapped.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()), tokenizer.get_vocab_size()


class GpuMemoryPoll:
    """Peak of the device's used memory (torch.cuda.mem_get_info) above its level at start, polled every 0.1 s."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.peak, self.stop = 0, threading.Event()
        if self.cuda:
            self.base = self.used()
            self.thread = threading.Thread(target=self.poll, daemon=True)
            self.thread.start()

    @staticmethod
    def used():
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def poll(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.used() - self.base)
            time.sleep(0.1)

    def finish(self):
        """The peak in GiB (None without CUDA)."""
        if not self.cuda:
            return None
        self.stop.set()
        self.thread.join()
        return round(self.peak / 2**30, 3)


def run_build(corpus, encoder, out, factory, search_params, args):
    """Run `python -m common.retrieval build`; returns (command, wall seconds, start time, peak GPU GiB)."""
    command = [sys.executable, "-m", "common.retrieval", "build", "--corpus", str(corpus), "--encoder", str(encoder),
               "--out", str(out), "--index_factory", factory, "--batch_size", str(args.batch_size)]  # fmt: skip
    command += ["--search_params", search_params] if search_params else []
    command += ["--dtype", args.dtype] if args.dtype else []
    command += ["--keep_embeddings"]  # their plan.json and shards time the stages; removed after
    poll = GpuMemoryPoll()
    start_wall, start = time.time(), time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # given explicitly: the tokenizer's fork handler cannot change it
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr)
    seconds, peak = time.perf_counter() - start, poll.finish()
    if done.returncode != 0:
        raise SystemExit(f"index_scale: the build failed (exit {done.returncode}): {' '.join(command)}")
    return " ".join(command[1:]), seconds, start_wall, peak


def main(argv=None):
    args = parse_args(argv)
    import faiss
    import torch

    records, started = [], time.perf_counter()

    def emit(record):
        records.append(record)
        print(json.dumps(record), flush=True)
        if args.json:
            Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in records))

    cuda = torch.cuda.is_available()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="index_scale_"))
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, encoder = workdir / "corpus.jsonl", workdir / "e5-base-v2-random"  # "e5" in the name: the E5 preset
    emit({"stage": "machine", "device": torch.cuda.get_device_name() if cuda else "cpu",
          "cpu_count": os.cpu_count(), "torch": torch.__version__, "faiss": faiss.__version__,
          "python": platform.python_version(), "workdir": str(workdir)})  # fmt: skip

    start = time.perf_counter()
    size, queries = write_corpus(corpus, args.passages, args.vocab_words, args.seed, args.queries)
    seconds = time.perf_counter() - start
    emit({"stage": "corpus", "passages": args.passages, "words_per_passage": WORDS_PER_PASSAGE,
          "vocab_words": args.vocab_words, "mib": round(size / 2**20, 1), "seconds": round(seconds, 2),
          "passages_per_s": round(args.passages / seconds)})  # fmt: skip

    start = time.perf_counter()
    params, vocab = make_encoder_folder(encoder, corpus, args.encoder_shape, args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(encoder)
    sample = ["passage: " + t for t in sample_passages(corpus, 10_000)]  # as HFEncoder encodes a passage
    lengths = [len(ids) for ids in tokenizer(sample, truncation=True, max_length=512)["input_ids"]]
    tokens_per_passage = float(np.mean(lengths))
    emit({"stage": "encoder", "shape": args.encoder_shape, "params_m": round(params / 1e6, 1),
          "tokenizer_vocab": vocab, "tokens_per_passage": round(tokens_per_passage, 1),
          "tokens_per_passage_max": max(lengths), "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip

    folders = {"Flat": workdir / "index_flat", args.ivf_factory: workdir / "index_ivf"}
    for factory, folder in folders.items():
        exact = factory == "Flat"
        if not exact:  # the Flat build's shards: the IVF build only indexes them
            folder.mkdir(parents=True, exist_ok=True)
            os.replace(folders["Flat"] / "embeddings", folder / "embeddings")
        command, wall, start_wall, peak = run_build(
            corpus, encoder, folder, factory, "" if exact else args.search_params, args
        )
        shards = folder / "embeddings"
        plan_t, done_t = (shards / "plan.json").stat().st_mtime, (folder / "retriever.json").stat().st_mtime
        record = {"stage": "build", "index": factory, "command": command, "seconds": round(wall, 2),
                  "startup_s": round(plan_t - start_wall, 2)}  # fmt: skip
        if exact:
            last_shard = max(f.stat().st_mtime for f in shards.glob("shard_*.npy"))
            encode_s = last_shard - plan_t
            record.update(encode_s=round(encode_s, 2), passages_per_s=round(args.passages / encode_s),
                          tokens_per_s=round(args.passages * tokens_per_passage / encode_s),
                          index_s=round(done_t - last_shard, 2))  # fmt: skip
        else:
            record["index_s"] = round(done_t - plan_t, 2)
        if not exact:
            shutil.rmtree(shards)
        record["index_bytes"] = (folder / "index.faiss").stat().st_size
        record["index_gib"] = round(record["index_bytes"] / 2**30, 3)
        record["peak_gpu_gib"] = peak
        emit(record)

    start = time.perf_counter()
    docs = load_corpus(corpus)
    retrievers = {factory: load_retriever(folder, corpus=docs) for factory, folder in folders.items()}
    first = next(iter(retrievers.values())).encoder
    emit({"stage": "load", "seconds": round(time.perf_counter() - start, 2), "device": str(first.device),
          "encoder_dtype": str(next(first.model.parameters()).dtype).replace("torch.", "")})  # fmt: skip
    vectors = {}
    for factory, retriever in retrievers.items():
        for batch in [int(b) for b in args.search_batches.split(",")]:
            calls = [queries[i : i + batch] for i in range(0, len(queries), batch)]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            retriever.search(calls[0][:2], args.k)  # warm-up (CUDA kernels, faiss threads)
            start = time.perf_counter()
            hits = [retriever.search(call, args.k) for call in calls]
            search_s = time.perf_counter() - start
            assert all(len(h) == args.k for call in hits for h in call), "a query got fewer than k hits"
            start = time.perf_counter()
            encoded = [retriever.encoder.encode(call, is_query=True) for call in calls]
            encode_s = time.perf_counter() - start
            start = time.perf_counter()
            ids = np.concatenate([retriever.index.search(v, args.k)[1] for v in encoded])
            faiss_s = time.perf_counter() - start
            vectors[factory] = (np.concatenate(encoded), ids)  # for the recall below
            emit({"stage": "search", "index": factory, "search_params": retriever.search_params, "batch": batch,
                  "queries": len(queries), "k": args.k, "queries_per_s": round(len(queries) / search_s, 1),
                  "encode_queries_per_s": round(len(queries) / encode_s, 1),
                  "faiss_queries_per_s": round(len(queries) / faiss_s, 1),
                  "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None})  # fmt: skip

    flat_vectors, flat_ids = vectors["Flat"]
    _, ivf_ids = retrievers[args.ivf_factory].index.search(flat_vectors, args.k)  # the same query vectors
    recall = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(ivf_ids, flat_ids)])
    emit({"stage": "recall", "index": args.ivf_factory, "search_params": args.search_params, "k": args.k,
          "queries": len(queries), "recall_at_k": round(float(recall), 4)})  # fmt: skip
    if not args.keep and args.workdir is None:
        shutil.rmtree(workdir)
    elif not args.keep:  # a given workdir: only what this script wrote
        corpus.unlink()
        for folder in [encoder, *folders.values()]:
            shutil.rmtree(folder)
    emit({"stage": "summary", "passages": args.passages, "seconds": round(time.perf_counter() - started, 1),
          "kept": str(workdir) if args.keep else None})  # fmt: skip


if __name__ == "__main__":
    main()
