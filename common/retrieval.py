"""Retrieval: FlashRAG corpus loading, encoders (offline TF-IDF, transformers), a faiss dense index, BM25.

    python -m common.retrieval build --corpus corpus.jsonl --encoder intfloat/e5-base-v2 --out index/e5
    python -m common.retrieval build --corpus corpus.jsonl --encoder bm25 --out index/bm25
    python -m common.retrieval search --index index/e5 --query "who directed kanikx" -k 5

`encoder` is "tfidf", "bm25" or a transformers encoder (hub id or local folder; E5/BGE/Contriever presets).
open_retriever(index, corpus, encoder) is what a run uses: the saved folder `index`, else one built over `corpus`.

A retriever folder holds retriever.json (kind "dense" or "bm25", corpus path, and for dense the encoder spec
and faiss factory string), doc_ids.json, corpus.jsonl when it was built from an in-memory corpus rather than a
file, and the index: index.faiss (dense) or bm25s's own files (BM25). Loading checks that the corpus has the
ids of doc_ids.json, in order. A dense folder also keeps faiss's search-time parameters (`--search_params nprobe=64`:
IVF indexes search with nprobe=1 otherwise). Building at scale (shards over processes, resume): common/indexing.py.

TF-IDF vectors are dense (passages x vocabulary, float32), so TF-IDF refuses corpora beyond TFIDF_MAX_CELLS
(the toy world is 401 x 526); BM25 and transformers encoders have no such limit. BM25 tokenises as FlashRAG's
bm25s builder does (English stopwords), but does not stem unless asked, since PyStemmer is not a dependency:
`pip install PyStemmer` and build with `--stemmer english` (BM25Retriever.build(corpus, stemmer="english")).
"""

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

from common import runs
from common.data import DataError, iter_jsonl, write_jsonl

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
ENCODER_PRESETS = {  # matched against the lowercased model name, first hit wins
    "bge": dict(pooling="cls", query_prefix=BGE_QUERY_INSTRUCTION, passage_prefix=""),
    "contriever": dict(pooling="mean", query_prefix="", passage_prefix=""),
    "e5": dict(pooling="mean", query_prefix="query: ", passage_prefix="passage: "),
}
BM25_FILES = (
    "params.index.json",
    "vocab.index.json",
    "data.csc.index.npy",
    "indices.csc.index.npy",
    "indptr.csc.index.npy",
)  # what bm25s.BM25.save writes (k1, b, method; vocabulary; sparse scores)
# Most cells (passages x vocabulary words) of a TF-IDF index: 0.4 GB of float32, and a build holds about two
# copies: 4,900 100-word passages x 20,081 words built with a peak RSS of 851 MiB. The toy world is 401 x 526;
# wiki-18 passages (about 16,000 words in 1,000) would reach the limit at about 3,000 passages.
TFIDF_MAX_CELLS = 100_000_000


class EncoderLoadError(ValueError):
    """An encoder or retriever cannot be made as asked: an unknown name or a model not loadable (not a local
    folder, and not in the hub cache when offline), TF-IDF over too large a corpus, stemming without PyStemmer."""


# ---------------------------------------------------------------- corpus


def split_contents(contents):
    """'"Title"\\ntext' -> ("Title", "text"); contents without a newline -> ("", contents)."""
    if "\n" not in contents:
        return "", contents.strip()
    title, text = contents.split("\n", 1)
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()


def load_corpus(path):
    """Load a FlashRAG corpus jsonl ({"id", "contents"}) as a list of {"id", "contents", "title", "text"}."""
    docs, seen = [], set()
    for lineno, row in iter_jsonl(path, required=("id", "contents")):
        doc_id, contents = row["id"], row["contents"]
        if not isinstance(contents, str):
            raise DataError(f"{path}:{lineno}: field 'contents' must be a string, got {type(contents).__name__}")
        if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool):
            raise DataError(f"{path}:{lineno}: field 'id' must be a string or an integer, got {doc_id!r}")
        if doc_id in seen:
            raise DataError(f"{path}:{lineno}: duplicate id {doc_id!r}")
        seen.add(doc_id)
        title, text = split_contents(contents)
        docs.append({"id": doc_id, "contents": contents, "title": title, "text": text})
    if not docs:
        raise DataError(f"{path}: no passages")
    return docs


def make_hit(doc, score):
    """A search hit from a doc (only "id" and "contents" are needed): id, title, text, contents, score."""
    title, text = split_contents(doc["contents"])
    return {"id": doc["id"], "title": title, "text": text, "contents": doc["contents"], "score": float(score)}


# ---------------------------------------------------------------- encoders


def tokenize_words(text):
    """Lowercase words: runs of letters and digits (anything else separates)."""
    return re.findall(r"[^\W_]+", text.lower())


class TfidfEncoder:
    """Offline dense encoder: log1p(tf) * idf over a vocabulary fitted on the corpus, rows L2-normalised."""

    def __init__(self, vocab=None, idf=None):
        self.vocab = {w: i for i, w in enumerate(vocab or [])}
        self.idf = np.asarray(idf if idf is not None else [], dtype=np.float32)

    @property
    def dim(self):
        return len(self.vocab)

    def fit(self, texts):
        """Fit vocabulary and idf = log((1 + N) / (1 + df)) + 1 on the texts; returns self."""
        df = Counter(w for text in texts for w in set(tokenize_words(text)))
        words = sorted(df)
        self.vocab = {w: i for i, w in enumerate(words)}
        self.idf = np.array([math.log((1 + len(texts)) / (1 + df[w])) + 1 for w in words], dtype=np.float32)
        return self

    def encode(self, texts, is_query=False):
        """(len(texts), dim) float32; unknown words are ignored, a text with none is the zero vector."""
        if not self.vocab:
            raise ValueError("TfidfEncoder is not fitted: call fit(texts) or build a DenseRetriever with it")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            counts = Counter(w for w in tokenize_words(text) if w in self.vocab)
            cols = [self.vocab[w] for w in counts]
            out[row, cols] = np.log1p(np.fromiter(counts.values(), np.float32, len(counts))) * self.idf[cols]
        return normalize_rows(out)

    def spec(self):
        """What load needs to rebuild this encoder."""
        return {"name": "tfidf", "vocab": list(self.vocab), "idf": self.idf.tolist()}


def normalize_rows(x):
    """L2-normalise the rows of a float matrix (zero rows stay zero)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def pool(last_hidden_state, attention_mask, pooling):
    """Sentence vectors from token states: masked mean over real tokens, or the first ([CLS]) token."""
    if pooling == "cls":
        return last_hidden_state[:, 0]
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
        return (last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1)
    raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")


class HFEncoder:
    """A transformers encoder (AutoModel) with pooling, query/passage prefixes and L2-normalised outputs."""

    def __init__(
        self,
        name_or_path,
        pooling="mean",
        query_prefix="",
        passage_prefix="",
        max_length=512,
        batch_size=64,
        device=None,
        dtype=None,
    ):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.name_or_path, self.pooling, self.max_length, self.batch_size = (
            name_or_path,
            pooling,
            max_length,
            batch_size,
        )
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # FlashRAG encodes in half precision on a GPU (retrieval_use_fp16: True); None: bfloat16 on CUDA, else float32
        self.dtype = dtype or ("bfloat16" if str(self.device).startswith("cuda") else "float32")
        local = Path(name_or_path).is_dir()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local)
            model = AutoModel.from_pretrained(name_or_path, local_files_only=local, dtype=getattr(torch, self.dtype))
            self.model = model.to(self.device).eval()
        except (OSError, ValueError) as e:
            offline = os.environ.get("HF_HUB_OFFLINE", "")
            raise EncoderLoadError(
                f"cannot load encoder {name_or_path!r}: not 'tfidf' or 'bm25', not a local "
                f"folder and not loadable from the hub (offline: HF_HUB_OFFLINE={offline!r}); "
                f"download it first or pass a local folder. ({str(e).splitlines()[0]})"
            ) from None
        self.dim = self.model.config.hidden_size

    def encode(self, texts, is_query=False):
        """(len(texts), dim) float32 rows of norm 1, in batches (a progress bar for long passage lists)."""
        import torch

        prefix = self.query_prefix if is_query else self.passage_prefix
        texts = [prefix + t for t in texts]
        starts = range(0, len(texts), self.batch_size)
        chunks = [np.zeros((0, self.dim), dtype=np.float32)]
        for start in runs.progress(starts, desc="encode", leave=False, disable=is_query or len(starts) < 2):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                states = self.model(**batch).last_hidden_state
                vectors = pool(states.float(), batch["attention_mask"], self.pooling)  # pooled in float32
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            chunks.append(vectors.float().cpu().numpy())
        return np.concatenate(chunks)

    def spec(self):
        """What load needs to rebuild this encoder (device, dtype and batch size are chosen at load time)."""
        return {
            "name": "hf",
            "name_or_path": str(self.name_or_path),
            "pooling": self.pooling,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
            "max_length": self.max_length,
        }


class CrossEncoderReranker:
    """A sequence-classification cross-encoder (BGE-reranker-v2): one relevance logit per (query, passage) pair."""

    def __init__(self, name, device, batch_size=64):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer, self.batch_size = AutoTokenizer.from_pretrained(name), batch_size
        self.model = AutoModelForSequenceClassification.from_pretrained(name).to(device).eval()

    def __call__(self, pairs):
        import torch

        out = [np.zeros(0)]
        for i in range(0, len(pairs), self.batch_size):
            batch = [list(p) for p in pairs[i : i + self.batch_size]]
            enc = self.tokenizer(batch, padding=True, truncation=True, max_length=512, return_tensors="pt")
            with torch.no_grad():
                out.append(self.model(**enc.to(self.model.device)).logits.view(-1).double().cpu().numpy())  # (b,)
        return np.concatenate(out)


def encoder_preset(name):
    """Pooling and prefixes documented for E5 / BGE / Contriever, looked up from the model name; else mean, none."""
    lowered = str(name).lower()
    for key, preset in ENCODER_PRESETS.items():
        if key in lowered:
            return dict(preset)
    return dict(pooling="mean", query_prefix="", passage_prefix="")


def make_encoder(name, **kwargs):
    """ "tfidf" -> TfidfEncoder (unfitted); else HFEncoder with the name's preset, overridden by kwargs."""
    if name == "tfidf":
        return TfidfEncoder(**kwargs)
    return HFEncoder(name, **{**encoder_preset(name), **kwargs})


def encoder_from_spec(spec, **kwargs):
    """Rebuild an encoder from its saved spec (kwargs such as device or batch_size go to HFEncoder)."""
    spec = dict(spec)
    if spec.pop("name") == "tfidf":
        return TfidfEncoder(spec["vocab"], spec["idf"])
    return HFEncoder(**spec, **kwargs)


# ---------------------------------------------------------------- retriever folders


def resolve_corpus(corpus):
    """A corpus given as a jsonl path or as docs -> (its absolute path, or None for docs; the docs)."""
    if isinstance(corpus, (str, Path)):
        return str(Path(corpus).resolve()), load_corpus(corpus)
    return None, corpus


def atomic_write(path, write):
    """Call write(tmp_path), then rename the temporary file to path."""
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


def write_folder(folder, retriever, meta, write_index):
    """Save a retriever: corpus.jsonl (if built from docs), its index (write_index(folder)), doc_ids.json, and last
    retriever.json (meta plus corpus path and size), so that a folder with a retriever.json is complete."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs = retriever.corpus
    if retriever.corpus_path is None:
        write_jsonl(folder / "corpus.jsonl", [{"id": d["id"], "contents": d["contents"]} for d in docs])
    write_index(folder)
    index_files = [f for f in folder.iterdir() if f.is_file() and f.name not in ("retriever.json", "doc_ids.json")]
    sizes = {f.name: f.stat().st_size for f in index_files if f.name != "corpus.jsonl"}  # read_folder checks them
    meta = {**meta, "corpus": retriever.corpus_path, "num_docs": len(docs), "sizes": sizes}
    atomic_write(folder / "doc_ids.json", lambda p: Path(p).write_text(json.dumps([d["id"] for d in docs])))
    atomic_write(folder / "retriever.json", lambda p: Path(p).write_text(json.dumps(meta)))


def read_folder(folder, kind, files, corpus=None):
    """(meta, docs, corpus path) of a saved retriever folder of this kind, after checking its files and that the
    corpus (given as docs or a path, else the recorded one) has the ids of doc_ids.json, in order."""
    folder, meta_path = Path(folder), Path(folder) / "retriever.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta and meta.get("kind", "dense") != kind:  # folders saved before BM25 folders existed have no kind: dense
        raise DataError(
            f"{meta_path}: field 'kind' is {meta.get('kind')!r}, not {kind!r} (load_retriever opens either kind)"
        )
    for name in ("retriever.json", "doc_ids.json", *files):
        if not (folder / name).is_file():
            raise DataError(f"{folder}: missing {name} (not a folder written by `python -m common.retrieval build`)")
    for name, size in meta.get("sizes", {}).items():  # a file cut short (an interrupted download or copy)
        if (folder / name).is_file() and (actual := (folder / name).stat().st_size) != size:
            raise DataError(f"{folder / name}: {actual} bytes where retriever.json records {size} (an interrupted "
                            "download or copy?): fetch or build the folder again")  # fmt: skip
    doc_ids = json.loads((folder / "doc_ids.json").read_text())
    if corpus is None:
        corpus_path = meta["corpus"]  # None: the corpus was saved in the folder
        docs = load_corpus(corpus_path or folder / "corpus.jsonl")
    else:
        corpus_path, docs = resolve_corpus(corpus)
    if [d["id"] for d in docs] != doc_ids:
        raise DataError(
            f"{folder}: the corpus {corpus_path or '(given)'} does not match doc_ids.json "
            f"({len(docs)} vs {len(doc_ids)} passages, or a different order)"
        )
    return meta, docs, corpus_path


def load_retriever(folder, corpus=None, **encoder_kwargs):
    """Load a saved retriever folder of either kind, as its retriever.json says (kwargs go to a dense encoder)."""
    path = Path(folder) / "retriever.json"
    if path.is_file() and json.loads(path.read_text()).get("kind") == "bm25":
        return BM25Retriever.load(folder, corpus)
    return DenseRetriever.load(folder, corpus, **encoder_kwargs)  # also the error for a folder missing files


def open_retriever(index, corpus, encoder="tfidf"):
    """The frozen retriever of a run: the saved folder `index` when set (its retriever.json says what it is; corpus
    and encoder are then unused), else one built over the `corpus` jsonl with `encoder`: "tfidf" (None too), "bm25",
    or a transformers encoder (hub id or local folder; build a large corpus's index once with the CLI instead)."""
    if index:
        return load_retriever(index)
    if not corpus:
        raise DataError("no corpus and no index: pass a corpus jsonl (--corpus) or a retriever folder (--index)")
    if encoder == "bm25":
        return BM25Retriever.build(corpus)
    return DenseRetriever.build(corpus, make_encoder(encoder or "tfidf"))


# ---------------------------------------------------------------- dense retrieval


def new_index(dim, index_factory, encoder, texts, train_size, seed=0):
    """An empty inner-product faiss index from a factory string, trained on a sample of texts if it needs it."""
    import faiss

    index = faiss.index_factory(dim, index_factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        rng = np.random.default_rng(seed)
        sample = rng.choice(len(texts), size=min(train_size, len(texts)), replace=False)
        index.train(encoder.encode([texts[i] for i in sorted(sample)]))
    return index


def fit_tfidf(encoder, texts):
    """A TF-IDF encoder fitted on texts (unless it is already), refused when its dense vectors would pass
    TFIDF_MAX_CELLS."""
    encoder = encoder if encoder.vocab else encoder.fit(texts)
    if len(texts) * encoder.dim > TFIDF_MAX_CELLS:
        raise EncoderLoadError(
            f"TF-IDF over {len(texts)} passages x {encoder.dim} words is a dense {len(texts) * encoder.dim * 4e-9:.1f}"
            f" GB matrix (more than TFIDF_MAX_CELLS = {TFIDF_MAX_CELLS:.0e} cells): use --encoder bm25, or a dense "
            "encoder such as intfloat/e5-base-v2 with `python -m common.retrieval build`"
        )
    return encoder


class DenseRetriever:
    """A faiss inner-product index over encoded passages, with the doc ids in index order; `search_params` (faiss
    ParameterSpace syntax: "nprobe=64", "efSearch=128") set the index's search-time parameters."""

    def __init__(self, index, corpus, encoder, corpus_path=None, index_factory="Flat", search_params=""):
        self.index, self.corpus, self.encoder = index, corpus, encoder
        self.corpus_path, self.index_factory, self.search_params = corpus_path, index_factory, search_params
        if search_params:
            import faiss

            faiss.ParameterSpace().set_index_parameters(index, search_params)

    @classmethod
    def build(cls, corpus, encoder, index_factory="Flat", chunk_size=100_000, train_size=100_000):
        """Encode a corpus (jsonl path, or docs with "id", "contents") in chunks into a new index; fits an unfitted
        TF-IDF, and refuses one whose dense vectors would pass TFIDF_MAX_CELLS."""
        corpus_path, docs = resolve_corpus(corpus)
        texts = [d["contents"] for d in docs]
        encoder = fit_tfidf(encoder, texts) if isinstance(encoder, TfidfEncoder) else encoder
        index = new_index(encoder.dim, index_factory, encoder, texts, train_size)
        starts = range(0, len(texts), chunk_size)
        for start in runs.progress(starts, desc="index", disable=len(starts) < 2):
            index.add(encoder.encode(texts[start : start + chunk_size]))
        return cls(index, docs, encoder, corpus_path, index_factory)

    def search(self, queries, k):
        """Top-k passages per query, best first: list (per query) of {"id","title","text","contents","score"}."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not queries:
            return []
        scores, ids = self.index.search(self.encoder.encode(list(queries), is_query=True), min(k, self.index.ntotal))
        return [
            [make_hit(self.corpus[i], s) for i, s in zip(row_ids, row_scores) if i >= 0]
            for row_ids, row_scores in zip(ids, scores)
        ]

    def save(self, folder):
        """Write index.faiss, doc_ids.json, retriever.json (and corpus.jsonl if built from a list), atomically."""
        import faiss

        meta = {"kind": "dense", "encoder": self.encoder.spec(), "index_factory": self.index_factory}
        meta["search_params"] = self.search_params
        write_folder(
            folder, self, meta, lambda f: atomic_write(f / "index.faiss", lambda p: faiss.write_index(self.index, p))
        )

    @classmethod
    def load(cls, folder, corpus=None, encoder=None, **encoder_kwargs):
        """Load a saved retriever; corpus (docs or path) defaults to the recorded one, encoder to the saved spec."""
        import faiss

        meta, docs, corpus_path = read_folder(folder, "dense", ["index.faiss"], corpus)
        index = faiss.read_index(str(Path(folder) / "index.faiss"))
        encoder = encoder or encoder_from_spec(meta["encoder"], **encoder_kwargs)
        return cls(index, docs, encoder, corpus_path, meta["index_factory"], meta.get("search_params", ""))


# ---------------------------------------------------------------- BM25


def make_stemmer(language):
    """A PyStemmer stemmer for bm25s, e.g. "english" (None: no stemming); PyStemmer is optional, not a dependency."""
    if language is None:
        return None
    try:
        import Stemmer
    except ImportError:
        raise EncoderLoadError(
            f"BM25 stemming ({language!r}) needs PyStemmer: pip install PyStemmer, or leave stemming off"
        ) from None
    return Stemmer.Stemmer(language)


class BM25Retriever:
    """Lexical BM25 through bm25s (English stopwords removed, stemmed if asked), same hits as DenseRetriever."""

    def __init__(self, model, corpus, stopwords="en", stemmer=None, corpus_path=None):
        self.model, self.corpus, self.stopwords, self.stemmer = model, corpus, stopwords, stemmer
        self.corpus_path, self.stem = corpus_path, make_stemmer(stemmer)

    @classmethod
    def build(cls, corpus, stopwords="en", stemmer=None, k1=1.5, b=0.75):
        """Index a corpus (list of docs or jsonl path) with BM25; stemmer: a PyStemmer language such as "english"."""
        import bm25s

        corpus_path, docs = resolve_corpus(corpus)
        retriever = cls(bm25s.BM25(k1=k1, b=b), docs, stopwords, stemmer, corpus_path)
        retriever.model.index(retriever.tokenize([d["contents"] for d in docs]), show_progress=False)
        return retriever

    def tokenize(self, texts, return_ids=True):
        """bm25s tokens of texts: lowercased words of 2+ characters, stopwords removed, stemmed if asked."""
        import bm25s

        return bm25s.tokenize(
            list(texts), stopwords=self.stopwords, stemmer=self.stem, return_ids=return_ids, show_progress=False
        )

    def save(self, folder):
        """Write bm25s's own files, doc_ids.json, retriever.json (and corpus.jsonl if built from a list)."""
        meta = {"kind": "bm25", "stopwords": self.stopwords, "stemmer": self.stemmer}
        write_folder(folder, self, meta, lambda f: self.model.save(str(f), show_progress=False))

    @classmethod
    def load(cls, folder, corpus=None):
        """Load a saved BM25 folder; corpus (docs or path) defaults to the recorded one."""
        import bm25s

        meta, docs, corpus_path = read_folder(folder, "bm25", BM25_FILES, corpus)
        model = bm25s.BM25.load(str(folder), show_progress=False)
        return cls(model, docs, meta["stopwords"], meta["stemmer"], corpus_path)

    def search(self, queries, k):
        """Top-k passages per query, best first (ties and zero scores fill up to k)."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not queries:
            return []
        tokens = self.tokenize(queries, return_ids=False)
        ids, scores = self.model.retrieve(tokens, k=min(k, len(self.corpus)), show_progress=False)
        return [
            [make_hit(self.corpus[i], s) for i, s in zip(row_ids, row_scores)]
            for row_ids, row_scores in zip(ids, scores)
        ]


# ---------------------------------------------------------------- CLI


def main(argv=None):
    """The command line (build, search): common.indexing, which builds large indexes in resumable shards."""
    from common.indexing import main as command_line

    return command_line(argv)


if __name__ == "__main__":
    from common.runs import run_main  # a user's mistake (missing corpus, unknown encoder ...): one line, exit 2

    run_main(main)
