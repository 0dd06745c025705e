"""Tests of common/retrieval.py: corpus parsing, TF-IDF values, dense (faiss) and BM25 search, save/load, CLI."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

from common import retrieval
from common.data import DataError
from common.retrieval import (
    BGE_QUERY_INSTRUCTION,
    BM25_FILES,
    BM25Retriever,
    DenseRetriever,
    EncoderLoadError,
    HFEncoder,
    TfidfEncoder,
    encoder_preset,
    load_corpus,
    load_retriever,
    main,
    make_encoder,
    open_retriever,
    split_contents,
)

REPO = Path(__file__).resolve().parents[1]

PASSAGES = [  # (id, title, text): toy-world style facts, one answer per query below
    ("d0", "kanikx", "kanikx is a film directed by velbo . kanikx was released in the year 1965 ."),
    ("d1", "velbo", "velbo is a person born in morazi . velbo works as a painter ."),
    ("d2", "morazi", "morazi is a city in tesland . morazi has a population of 40000 ."),
    ("d3", "tesland", "tesland is a country . the capital of tesland is morazi ."),
    ("d4", "pirulo", "pirulo is a film directed by zandra . pirulo was released in the year 1971 ."),
    ("d5", "zandra", "zandra is a person born in quelport . zandra works as a sculptor ."),
    ("d6", "quelport", "quelport is a city in vantria . quelport has a harbour ."),
    ("d7", "vantria", "vantria is a country . the capital of vantria is lumeno ."),
    ("d8", "lumeno", "lumeno is a city in vantria . lumeno has a cathedral ."),
    ("d9", "okabi", "okabi is a band formed in lumeno . okabi plays jazz ."),
    ("d10", "fernwick", "fernwick is a novel written by zandra . fernwick was published in 1980 ."),
    ("d11", "drumlet", "drumlet is a river flowing through tesland and vantria ."),
]
QUERIES = {  # query -> id of the passage that must come first
    "kanikx released": "d0",
    "who directed pirulo": "d4",
    "where was velbo born": "d1",
    "capital of vantria": "d7",
    "okabi jazz band": "d9",
    "fernwick novel published": "d10",
    "river drumlet": "d11",
}


def write_corpus(path, passages=PASSAGES):
    """Write passages as a FlashRAG corpus jsonl with '"Title"\\ntext' contents."""
    with open(path, "w", encoding="utf-8") as f:
        for doc_id, title, text in passages:
            f.write(json.dumps({"id": doc_id, "contents": f'"{title}"\n{text}'}) + "\n")
    return path


@pytest.fixture
def corpus_path(tmp_path):
    return write_corpus(tmp_path / "corpus.jsonl")


@pytest.fixture
def dense(corpus_path):
    return DenseRetriever.build(corpus_path, make_encoder("tfidf"))


# ---------------------------------------------------------------- corpus


def test_load_corpus_parses_titles(corpus_path):
    docs = load_corpus(corpus_path)
    assert [d["id"] for d in docs] == [p[0] for p in PASSAGES]
    assert docs[0] == {
        "id": "d0",
        "contents": '"kanikx"\n' + PASSAGES[0][2],
        "title": "kanikx",
        "text": PASSAGES[0][2],
    }


def test_split_contents_cases():
    assert split_contents('"A b"\nsome text\nmore') == ("A b", "some text\nmore")
    assert split_contents("Plain title\ntext") == ("Plain title", "text")
    assert split_contents("no newline at all") == ("", "no newline at all")
    assert split_contents('"Quoted "inner" title"\nx') == ('Quoted "inner" title', "x")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "a"}', "missing field 'contents'"),
        ('{"contents": "x"}', "missing field 'id'"),
        ('{"id": "a", "contents": 3}', "field 'contents' must be a string"),
        ('{"id": "d0", "contents": "dup"}', "duplicate id 'd0'"),
    ],
)
def test_load_corpus_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "d0", "contents": "\\"t\\"\\nx"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl:2: {message}"):
        load_corpus(path)


# ---------------------------------------------------------------- TF-IDF


def test_tfidf_values_by_hand():
    # idf = log((1 + N) / (1 + df)) + 1 with N = 3: the (df 3) -> 1, cat (df 2) -> 1.287682, dog (df 1) -> 1.693147
    # weight = log1p(tf) * idf, then each row L2-normalised; vocabulary sorted: cat, dog, the
    enc = TfidfEncoder().fit(["The cat.", "the dog", "the cat, CAT"])
    assert list(enc.vocab) == ["cat", "dog", "the"]
    np.testing.assert_allclose(enc.idf, [1.2876821, 1.6931472, 1.0], rtol=1e-6)
    got = enc.encode(["The cat.", "the dog", "the cat, CAT"])
    want = [
        [0.7898069, 0.0, 0.6133555],  # (log 2 * 1.287682, log 2 * 1) / norm
        [0.0, 0.8610370, 0.5085423],  # (log 2 * 1.693147, log 2 * 1) / norm
        [0.8979998, 0.0, 0.4399959],
    ]  # (log 3 * 1.287682, log 2 * 1) / norm
    assert got.dtype == np.float32 and got.shape == (3, 3)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(enc.encode(["cat zebra", "zebra"], is_query=True), [[1, 0, 0], [0, 0, 0]])


def test_tfidf_unfitted_is_an_error():
    with pytest.raises(ValueError, match="not fitted"):
        TfidfEncoder().encode(["x"])


# ---------------------------------------------------------------- dense search


def test_dense_known_answers(dense):
    results = dense.search(list(QUERIES), k=3)
    assert [hits[0]["id"] for hits in results] == list(QUERIES.values())
    for hits in results:
        scores = [h["score"] for h in hits]
        assert len(hits) == 3 and scores == sorted(scores, reverse=True) and scores[0] > scores[1]
    top = results[0][0]
    assert top["title"] == "kanikx" and top["text"] == PASSAGES[0][2] and top["contents"].startswith('"kanikx"\n')
    assert 0 < top["score"] <= 1.0 + 1e-6


def test_dense_score_is_cosine_of_tfidf_vectors(dense):
    hit = dense.search(["kanikx released"], k=1)[0][0]
    q = dense.encoder.encode(["kanikx released"], is_query=True)[0]
    p = dense.encoder.encode([hit["contents"]])[0]
    assert hit["score"] == pytest.approx(float(q @ p), abs=1e-5)


def test_dense_k_larger_than_corpus_and_empty_queries(dense):
    hits = dense.search(["kanikx"], k=100)[0]
    assert len(hits) == len(PASSAGES) and sorted(h["id"] for h in hits) == sorted(p[0] for p in PASSAGES)
    assert dense.search([], k=5) == []
    with pytest.raises(ValueError, match="k must be at least 1"):
        dense.search(["kanikx"], k=0)


def test_dense_build_from_docs_list_equals_build_from_path(corpus_path, dense):
    from_list = DenseRetriever.build(load_corpus(corpus_path), make_encoder("tfidf"))
    assert from_list.search(list(QUERIES), k=4) == dense.search(list(QUERIES), k=4)


def test_save_load_gives_identical_results(dense, tmp_path):
    dense.save(tmp_path / "idx")
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == ["doc_ids.json", "index.faiss", "retriever.json"]
    loaded = DenseRetriever.load(tmp_path / "idx")
    assert loaded.search(list(QUERIES), k=5) == dense.search(list(QUERIES), k=5)


def test_save_load_from_docs_list_copies_corpus(corpus_path, tmp_path):
    retriever = DenseRetriever.build(load_corpus(corpus_path), make_encoder("tfidf"))
    retriever.save(tmp_path / "idx")
    corpus_path.unlink()
    assert (tmp_path / "idx" / "corpus.jsonl").is_file()
    assert DenseRetriever.load(tmp_path / "idx").search(["river drumlet"], 2) == retriever.search(["river drumlet"], 2)


def test_load_with_explicit_corpus_and_mismatch(dense, tmp_path):
    dense.save(tmp_path / "idx")
    moved = write_corpus(tmp_path / "moved.jsonl")
    assert DenseRetriever.load(tmp_path / "idx", corpus=moved).search(["okabi"], 1)[0][0]["id"] == "d9"
    other = write_corpus(tmp_path / "other.jsonl", PASSAGES[:5])
    with pytest.raises(DataError, match="does not match doc_ids.json"):
        DenseRetriever.load(tmp_path / "idx", corpus=other)


def test_load_missing_file_names_folder_and_file(dense, tmp_path):
    dense.save(tmp_path / "idx")
    (tmp_path / "idx" / "doc_ids.json").unlink()
    with pytest.raises(DataError, match=r"idx: missing doc_ids.json"):
        DenseRetriever.load(tmp_path / "idx")


@pytest.mark.parametrize("factory", ["IVF2,Flat", "HNSW8"])
def test_other_index_factories_find_the_same_top1(corpus_path, factory):
    retriever = DenseRetriever.build(corpus_path, make_encoder("tfidf"), index_factory=factory)
    if factory.startswith("IVF"):
        retriever.index.nprobe = 2  # all lists: exact search
    assert retriever.index.ntotal == len(PASSAGES)
    assert [h[0]["id"] for h in retriever.search(list(QUERIES), k=1)] == list(QUERIES.values())


def test_chunked_build_equals_one_chunk(corpus_path, dense):
    chunked = DenseRetriever.build(corpus_path, make_encoder("tfidf"), chunk_size=5)
    assert chunked.search(list(QUERIES), k=5) == dense.search(list(QUERIES), k=5)


# ---------------------------------------------------------------- building at scale (common/indexing.py)


def vectors(folder):
    """The vectors of a saved dense folder's faiss index, in index order."""
    import faiss

    index = faiss.read_index(str(Path(folder) / "index.faiss"))
    return index.reconstruct_n(0, index.ntotal)


def test_sharded_build_in_two_processes_gives_the_index_of_one(corpus_path, tmp_path):
    from common.indexing import build_sharded

    one = build_sharded(corpus_path, make_encoder("tfidf"), tmp_path / "one", shard_size=5, keep=True)
    assert sorted(p.name for p in (tmp_path / "one" / "embeddings").glob("*.npy")) == [
        f"shard_0000{i}.npy"
        for i in range(3)  # 12 passages in shards of 5
    ]
    assert np.load(tmp_path / "one" / "embeddings" / "shard_00002.npy").dtype == np.float16
    launch = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", free_port()]
    command = ["-m", "common.retrieval", "build", "--corpus", str(corpus_path), "--encoder", "tfidf"]
    command += ["--out", str(tmp_path / "two"), "--shard_size", "5"]
    out = subprocess.run(launch + command, cwd=REPO, capture_output=True, text=True, env=os.environ | {"CI": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "encode (process 1)" in out.stderr and out.stdout.count("indexed 12 passages") == 1  # main prints
    assert (tmp_path / "one" / "index.faiss").read_bytes() == (tmp_path / "two" / "index.faiss").read_bytes()
    assert not (tmp_path / "two" / "embeddings").exists()  # deleted once the folder is saved
    assert load_retriever(tmp_path / "two").search(list(QUERIES), k=5) == one.search(list(QUERIES), k=5)


def test_an_interrupted_build_encodes_only_the_shards_not_yet_written(corpus_path, tmp_path, monkeypatch):
    from common.indexing import build_sharded

    encode, calls, stop_at = TfidfEncoder.encode, [], [2]

    def counted(self, texts, is_query=False):
        calls.append(texts[0])
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt  # killed while encoding the second shard
        return encode(self, texts, is_query)

    monkeypatch.setattr(TfidfEncoder, "encode", counted)
    with pytest.raises(KeyboardInterrupt):
        build_sharded(corpus_path, make_encoder("tfidf"), tmp_path / "ix", shard_size=5)
    assert [p.name for p in (tmp_path / "ix" / "embeddings").glob("*.npy")] == ["shard_00000.npy"]
    assert not (tmp_path / "ix" / "retriever.json").exists()  # no folder claims to be complete
    calls.clear()
    stop_at[0] = 0  # no more interruptions
    build_sharded(corpus_path, make_encoder("tfidf"), tmp_path / "ix", shard_size=5)
    assert calls == [f'"{PASSAGES[5][1]}"\n{PASSAGES[5][2]}', f'"{PASSAGES[10][1]}"\n{PASSAGES[10][2]}']
    build_sharded(corpus_path, make_encoder("tfidf"), tmp_path / "fresh", shard_size=5)
    np.testing.assert_array_equal(vectors(tmp_path / "ix"), vectors(tmp_path / "fresh"))  # as if never stopped


def test_a_build_refuses_the_shards_of_another_build(corpus_path, tmp_path):
    from common.indexing import build_sharded

    build_sharded(corpus_path, make_encoder("tfidf"), tmp_path / "ix", shard_size=5, keep=True)
    with pytest.raises(EncoderLoadError, match=r"embeddings holds the shards of another build \(plan.json\)"):
        build_sharded(corpus_path, make_encoder("tfidf"), tmp_path / "ix", shard_size=4)


@pytest.mark.parametrize("factory, params, read", [("IVF2,Flat", "nprobe=2", lambda ix: ix.nprobe),
                                                   ("HNSW8", "efSearch=64", lambda ix: ix.hnsw.efSearch)])  # fmt: skip
def test_search_params_are_saved_and_applied_on_load(corpus_path, tmp_path, factory, params, read):
    import faiss

    from common.indexing import main as cli

    cli(["build", "--corpus", str(corpus_path), "--encoder", "tfidf", "--out", str(tmp_path / "ix"),
         "--index_factory", factory, "--search_params", params])  # fmt: skip
    retriever = load_retriever(tmp_path / "ix")
    index = faiss.extract_index_ivf(retriever.index) if factory.startswith("IVF") else retriever.index
    assert read(index) == int(params.split("=")[1]) and retriever.search_params == params
    assert [h[0]["id"] for h in retriever.search(list(QUERIES), k=1)] == list(QUERIES.values())


# ---------------------------------------------------------------- BM25


def test_bm25_obvious_ranking():
    docs = [
        {"id": i, "contents": c}
        for i, c in enumerate(
            ["apples and pears", "zebra zebra zebra stripes", "a zebra in the zoo", "cars and trucks"]
        )
    ]
    hits = BM25Retriever.build(docs).search(["zebra", "trucks", "nothing matches"], k=10)
    assert [h["id"] for h in hits[0][:2]] == [1, 2] and hits[0][2]["score"] == 0.0
    assert hits[1][0]["id"] == 3 and len(hits[1]) == 4
    assert all(h["score"] == 0.0 for h in hits[2])


def test_bm25_known_answers(corpus_path):
    bm25 = BM25Retriever.build(corpus_path)
    results = bm25.search(list(QUERIES), k=3)
    assert [hits[0]["id"] for hits in results] == list(QUERIES.values())
    assert all([h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True) for hits in results)
    assert bm25.search([], 3) == []


def test_open_retriever_bm25_builds_over_the_corpus(corpus_path):
    bm25 = open_retriever("", corpus_path, "bm25")
    assert isinstance(bm25, BM25Retriever) and bm25.stemmer is None
    assert [h[0]["id"] for h in bm25.search(list(QUERIES), 1)] == list(QUERIES.values())
    assert bm25.search(list(QUERIES), 5) == BM25Retriever.build(load_corpus(corpus_path)).search(list(QUERIES), 5)


@pytest.mark.parametrize("from_docs", [False, True])
def test_bm25_save_load_gives_identical_results(corpus_path, tmp_path, from_docs):
    built = BM25Retriever.build(load_corpus(corpus_path) if from_docs else corpus_path)
    built.save(tmp_path / "bm25")
    files = sorted(p.name for p in (tmp_path / "bm25").iterdir())
    want_files = {*BM25_FILES, "doc_ids.json", "retriever.json"} | ({"corpus.jsonl"} if from_docs else set())
    assert files == sorted(want_files)
    meta = json.loads((tmp_path / "bm25" / "retriever.json").read_text())
    assert meta == {
        "kind": "bm25",
        "stopwords": "en",
        "stemmer": None,
        "num_docs": len(PASSAGES),
        "corpus": None if from_docs else str(corpus_path.resolve()),
        "sizes": {name: (tmp_path / "bm25" / name).stat().st_size for name in BM25_FILES},  # bm25s's files only
    }
    if from_docs:
        corpus_path.unlink()  # the folder's own corpus.jsonl is read
    want = built.search(list(QUERIES) + ["nothing matches here"], 5)
    for loaded in (
        BM25Retriever.load(tmp_path / "bm25"),
        load_retriever(tmp_path / "bm25"),
        open_retriever(str(tmp_path / "bm25"), "no/such/corpus.jsonl", "tfidf"),
    ):  # the folder says bm25
        assert isinstance(loaded, BM25Retriever)
        assert loaded.search(list(QUERIES) + ["nothing matches here"], 5) == want


def test_bm25_folder_refuses_a_mismatched_corpus(corpus_path, tmp_path):
    BM25Retriever.build(corpus_path).save(tmp_path / "bm25")
    fewer = write_corpus(tmp_path / "fewer.jsonl", PASSAGES[:5])
    with pytest.raises(DataError, match=r"bm25: the corpus .*fewer.jsonl does not match doc_ids.json \(5 vs 12"):
        BM25Retriever.load(tmp_path / "bm25", corpus=fewer)
    with pytest.raises(DataError, match="does not match doc_ids.json"):  # same ids, another order
        load_retriever(tmp_path / "bm25", corpus=write_corpus(tmp_path / "reordered.jsonl", PASSAGES[::-1]))
    moved = write_corpus(tmp_path / "moved.jsonl")
    assert BM25Retriever.load(tmp_path / "bm25", corpus=moved).search(["okabi"], 1)[0][0]["id"] == "d9"
    (tmp_path / "bm25" / "vocab.index.json").unlink()
    with pytest.raises(DataError, match="bm25: missing vocab.index.json"):
        load_retriever(tmp_path / "bm25")


def test_a_folder_of_one_kind_is_not_loaded_as_the_other(dense, corpus_path, tmp_path):
    dense.save(tmp_path / "dense")
    BM25Retriever.build(corpus_path).save(tmp_path / "bm25")
    with pytest.raises(DataError, match=r"retriever.json: field 'kind' is 'dense', not 'bm25'"):
        BM25Retriever.load(tmp_path / "dense")
    with pytest.raises(DataError, match=r"retriever.json: field 'kind' is 'bm25', not 'dense'"):
        DenseRetriever.load(tmp_path / "bm25")
    meta = json.loads((tmp_path / "dense" / "retriever.json").read_text())
    assert meta.pop("kind") == "dense"
    (tmp_path / "dense" / "retriever.json").write_text(json.dumps(meta))  # a folder saved before kinds existed
    assert load_retriever(tmp_path / "dense").search(list(QUERIES), 3) == dense.search(list(QUERIES), 3)


class FakeStemmer:
    """Stands in for PyStemmer's Stemmer.Stemmer (not a dependency): drops one trailing 's'."""

    def __init__(self, language):
        assert language == "english"

    def stemWords(self, words):
        return [w.removesuffix("s") for w in words]


def test_bm25_stemming_through_pystemmer(monkeypatch, tmp_path):
    docs = [{"id": "a", "contents": "a zebra runs"}, {"id": "b", "contents": "cars and trucks"}]
    assert BM25Retriever.build(docs).search(["zebras"], 2)[0][0]["score"] == 0.0  # no stemming: no match
    monkeypatch.setitem(sys.modules, "Stemmer", type(sys)("Stemmer"))
    sys.modules["Stemmer"].Stemmer = FakeStemmer
    stemmed = BM25Retriever.build(docs, stemmer="english")
    hits = stemmed.search(["zebras", "truck"], 1)
    assert [h[0]["id"] for h in hits] == ["a", "b"] and hits[0][0]["score"] > 0
    stemmed.save(tmp_path / "bm25")
    assert json.loads((tmp_path / "bm25" / "retriever.json").read_text())["stemmer"] == "english"
    assert load_retriever(tmp_path / "bm25").search(["zebras", "truck"], 1) == hits  # queries stemmed on load too


def test_bm25_stemming_without_pystemmer_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "Stemmer", None)  # import Stemmer raises ImportError
    with pytest.raises(EncoderLoadError, match="needs PyStemmer: pip install PyStemmer"):
        BM25Retriever.build([{"id": 0, "contents": "x"}], stemmer="english")


# ---------------------------------------------------------------- user errors


def test_tfidf_refuses_a_corpus_past_the_size_limit(corpus_path, monkeypatch):
    cells = len(PASSAGES) * TfidfEncoder().fit([d["contents"] for d in load_corpus(corpus_path)]).dim
    monkeypatch.setattr(retrieval, "TFIDF_MAX_CELLS", cells)
    assert open_retriever("", corpus_path, "tfidf").search(["river drumlet"], 1)[0][0]["id"] == "d11"  # at the limit
    monkeypatch.setattr(retrieval, "TFIDF_MAX_CELLS", cells - 1)
    with pytest.raises(EncoderLoadError) as error:
        open_retriever("", corpus_path, "tfidf")
    message = str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in message
    assert f"TF-IDF over {len(PASSAGES)} passages" in message and "TFIDF_MAX_CELLS" in message
    assert "--encoder bm25" in message and "intfloat/e5-base-v2 with `python -m common.retrieval build`" in message
    with pytest.raises(EncoderLoadError, match="--encoder bm25"):
        main(["build", "--corpus", str(corpus_path), "--encoder", "tfidf", "--out", str(corpus_path.parent / "x")])
    assert BM25Retriever.build(corpus_path).search(["river drumlet"], 1)[0][0]["id"] == "d11"  # BM25 has no limit


def test_toy_world_tfidf_is_far_below_the_limit():
    docs = load_corpus(REPO / "data" / "toy" / "corpus.jsonl")
    enc = TfidfEncoder().fit([d["contents"] for d in docs])
    assert len(docs) * enc.dim * 100 < retrieval.TFIDF_MAX_CELLS


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda p: open_retriever("", None, "bm25"), DataError, "no corpus and no index"),
        (lambda p: open_retriever("", p / "missing.jsonl", "bm25"), DataError, "missing.jsonl: file not found"),
        (lambda p: open_retriever("", p / "missing.jsonl", "tfidf"), DataError, "missing.jsonl: file not found"),
        (
            lambda p: open_retriever("", p / "corpus.jsonl", "no-such-encoder"),
            EncoderLoadError,
            "cannot load encoder 'no-such-encoder': not 'tfidf' or 'bm25'",
        ),
        (
            lambda p: open_retriever(str(p / "no_index"), p / "corpus.jsonl"),
            DataError,
            "no_index: missing retriever.json",
        ),
        (
            lambda p: main(
                [
                    "build",
                    "--corpus",
                    str(p / "corpus.jsonl"),
                    "--encoder",
                    "tfidf",
                    "--stemmer",
                    "english",
                    "--out",
                    str(p / "x"),
                ]
            ),
            EncoderLoadError,
            "--stemmer is for --encoder bm25",
        ),
    ],
)
def test_user_errors_are_value_errors_naming_what_is_wrong(corpus_path, call, error, message):
    assert issubclass(error, ValueError)
    with pytest.raises(error, match=message):
        call(corpus_path.parent)


# ---------------------------------------------------------------- transformers encoder

WORDS = ["query", ":", "passage", "the", "cat", "sat", "on", "mat", "dog", "a", "red"]


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory):
    """A random 1-layer BERT and a WordLevel tokenizer ([CLS] x [SEP]) saved to a folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )
    torch.manual_seed(0)
    model = BertModel(
        BertConfig(
            vocab_size=len(vocab),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    )
    folder = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def states_alone(encoder, text):
    """last_hidden_state of one unpadded text, computed directly with the encoder's model and tokenizer."""
    import torch

    with torch.inference_mode():
        return encoder.model(**encoder.tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy()


TEXTS = ["the cat sat on the mat", "a red dog", "cat"]  # different lengths, so the batch is padded


def test_hf_mean_pooling_matches_hand_computation(tiny_encoder_dir):
    enc = HFEncoder(str(tiny_encoder_dir), pooling="mean", batch_size=2, device="cpu")
    got = enc.encode(TEXTS)
    want = np.stack([states_alone(enc, t).mean(0) for t in TEXTS])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert got.dtype == np.float32 and got.shape == (3, 16)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_hf_encoder_runs_in_the_dtype_asked_float32_by_default_on_cpu(tiny_encoder_dir):
    import torch

    full = HFEncoder(str(tiny_encoder_dir), device="cpu")
    half = HFEncoder(str(tiny_encoder_dir), device="cpu", dtype="bfloat16")  # a GPU's default
    assert full.model.dtype == torch.float32 and half.model.dtype == torch.bfloat16
    got, want = half.encode(TEXTS), full.encode(TEXTS)
    assert got.dtype == np.float32 and not np.array_equal(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # pooled and normalised in float32
    np.testing.assert_allclose(got, want, atol=0.05)


def test_hf_cls_pooling_matches_hand_computation(tiny_encoder_dir):
    enc = HFEncoder(str(tiny_encoder_dir), pooling="cls", device="cpu")
    got = enc.encode(TEXTS)
    want = np.stack([states_alone(enc, t)[0] for t in TEXTS])
    np.testing.assert_allclose(got, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-5)
    assert not np.allclose(
        got, HFEncoder(str(tiny_encoder_dir), pooling="mean", device="cpu").encode(TEXTS), atol=1e-3
    )


def test_hf_prefixes_are_prepended(tiny_encoder_dir):
    enc = make_encoder(str(tiny_encoder_dir), query_prefix="query: ", passage_prefix="passage: ", device="cpu")
    plain = HFEncoder(str(tiny_encoder_dir), device="cpu")
    np.testing.assert_allclose(enc.encode(["red dog"], is_query=True), plain.encode(["query: red dog"]), atol=1e-6)
    np.testing.assert_allclose(enc.encode(["red dog"]), plain.encode(["passage: red dog"]), atol=1e-6)
    assert not np.allclose(enc.encode(["red dog"], is_query=True), plain.encode(["red dog"]), atol=1e-3)


def test_hf_dense_retriever_save_load(tiny_encoder_dir, corpus_path, tmp_path):
    enc = HFEncoder(str(tiny_encoder_dir), pooling="cls", query_prefix="query: ", device="cpu")
    retriever = DenseRetriever.build(corpus_path, enc)
    retriever.save(tmp_path / "idx")
    spec = json.loads((tmp_path / "idx" / "retriever.json").read_text())["encoder"]
    assert spec == {
        "name": "hf",
        "name_or_path": str(tiny_encoder_dir),
        "pooling": "cls",
        "query_prefix": "query: ",
        "passage_prefix": "",
        "max_length": 512,
    }
    loaded = DenseRetriever.load(tmp_path / "idx", device="cpu")
    assert loaded.search(["the cat", "red dog"], 4) == retriever.search(["the cat", "red dog"], 4)


def test_encoder_presets():
    assert encoder_preset("intfloat/e5-base-v2") == {
        "pooling": "mean",
        "query_prefix": "query: ",
        "passage_prefix": "passage: ",
    }
    assert encoder_preset("BAAI/bge-large-en-v1.5") == {
        "pooling": "cls",
        "query_prefix": BGE_QUERY_INSTRUCTION,
        "passage_prefix": "",
    }
    assert encoder_preset("facebook/contriever-msmarco") == {
        "pooling": "mean",
        "query_prefix": "",
        "passage_prefix": "",
    }
    assert encoder_preset("/models/my-encoder") == {"pooling": "mean", "query_prefix": "", "passage_prefix": ""}


def test_unloadable_encoder_is_a_clear_error():
    with pytest.raises(EncoderLoadError, match="cannot load encoder 'no-such-org/no-such-encoder'"):
        make_encoder("no-such-org/no-such-encoder")


# ---------------------------------------------------------------- CLI


def test_cli_build_then_load_and_search(corpus_path, tmp_path):
    out = tmp_path / "cli_idx"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "common.retrieval",
            "build",
            "--corpus",
            str(corpus_path),
            "--encoder",
            "tfidf",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    assert f"indexed {len(PASSAGES)} passages" in run.stdout
    loaded = DenseRetriever.load(out)
    assert [h[0]["id"] for h in loaded.search(list(QUERIES), k=2)] == list(QUERIES.values())
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "common.retrieval",
            "search",
            "--index",
            str(out),
            "--query",
            "kanikx released",
            "--query",
            "capital of vantria",
            "-k",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(line["query"], line["hits"][0]["id"], len(line["hits"])) for line in lines] == [
        ("kanikx released", "d0", 2),
        ("capital of vantria", "d7", 2),
    ]


def test_open_retriever_builds_once_or_loads_a_saved_index(corpus_path, tmp_path):
    from common.retrieval import open_retriever

    built = open_retriever("", corpus_path)  # no index: built over the corpus with the default TF-IDF encoder
    assert built.search(["capital of vantria"], 1)[0][0]["id"] == "d7"
    built.save(tmp_path / "index")
    loaded = open_retriever(str(tmp_path / "index"), "no/such/corpus.jsonl")  # the index wins; the corpus is not read
    assert [h[0]["id"] for h in loaded.search(list(QUERIES), 1)] == list(QUERIES.values())


def test_cli_bm25_build_then_search(corpus_path, tmp_path, capsys):
    out = tmp_path / "bm25"
    main(["build", "--corpus", str(corpus_path), "--encoder", "bm25", "--out", str(out)])
    assert f"indexed {len(PASSAGES)} passages (bm25, stemmer None) into {out}" in capsys.readouterr().out
    assert json.loads((out / "retriever.json").read_text())["kind"] == "bm25"
    main(["search", "--index", str(out), "--query", "who directed pirulo", "--query", "okabi jazz band", "-k", "3"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["query"], line["hits"][0]["id"], len(line["hits"])) for line in lines] == [
        ("who directed pirulo", "d4", 3),
        ("okabi jazz band", "d9", 3),
    ]
    assert lines[0]["hits"] == BM25Retriever.build(corpus_path).search(["who directed pirulo"], 3)[0]
    other = write_corpus(tmp_path / "other.jsonl", PASSAGES[1:])
    with pytest.raises(DataError, match="does not match doc_ids.json"):
        main(["search", "--index", str(out), "--corpus", str(other), "--query", "okabi"])


def test_cli_user_error_is_one_line_and_exit_code_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [
        sys.executable,
        "-m",
        "common.retrieval",
        "build",
        "--corpus",
        str(tmp_path / "none.jsonl"),
        "--encoder",
        "bm25",
        "--out",
        str(tmp_path / "out"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    assert run.returncode == 2 and run.stderr == f"error: {tmp_path / 'none.jsonl'}: file not found\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind, name", [("dense", "index.faiss"), ("bm25", "data.csc.index.npy")])
def test_a_folder_with_a_file_cut_short_is_refused_naming_it(corpus_path, tmp_path, kind, name):
    build = (
        DenseRetriever.build(corpus_path, make_encoder("tfidf"))
        if kind == "dense"
        else BM25Retriever.build(corpus_path)
    )
    build.save(tmp_path / "ix")
    meta = json.loads((tmp_path / "ix" / "retriever.json").read_text())
    assert meta["sizes"][name] == (tmp_path / "ix" / name).stat().st_size > 0
    data = (tmp_path / "ix" / name).read_bytes()
    (tmp_path / "ix" / name).write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(DataError, match=rf"{name}: {len(data) // 2} bytes where retriever.json records {len(data)} "):
        load_retriever(tmp_path / "ix")
    out = subprocess.run([sys.executable, "-m", "common.retrieval", "search", "--index", str(tmp_path / "ix"),
                          "--query", "x"], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1
