"""The toy world: generator determinism, world properties (on the committed world and a fresh seed), the toy reader,
the tiny model and tokenizer, and the renaming augmentation. Every figure asserted here is in docs/toy_world.md."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from common import toy  # noqa: E402
from common.data import load_qa, read_jsonl  # noqa: E402

COMMITTED = toy.DEFAULT_WORLD
TYPES = ("one_hop", "two_hop", "three_hop", "comparison", "yes_no")


@pytest.fixture(scope="module")
def seed1_world(tmp_path_factory):
    """A freshly generated world with another seed."""
    return toy.write_world(tmp_path_factory.mktemp("seed1"), seed=1)


@pytest.fixture(scope="module", params=["committed", "seed1"])
def world_dir(request, seed1_world):
    """Both worlds: properties must hold for any seed."""
    return COMMITTED if request.param == "committed" else seed1_world


@pytest.fixture(scope="module")
def tables(seed1_world):
    """Baseline tables of both worlds, computed once."""
    return {str(d): toy.baselines(d) for d in (COMMITTED, seed1_world)}


def reader_answer(reader, question, passages=()):
    """One answer of the toy reader to a question with passages."""
    docs = [{"contents": p} for p in passages]
    return reader.chat([[{"role": "user", "content": toy.reader_prompt(question, docs)}]])[0]


# ---------------------------------------------------------------- generator


def test_same_seed_same_bytes_and_committed_world_is_seed_0(tmp_path):
    a, b = toy.write_world(tmp_path / "a", seed=0), toy.write_world(tmp_path / "b", seed=0)
    for name in ("corpus.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl", "triples.jsonl", "world.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes() == (COMMITTED / name).read_bytes(), name
    assert (seed1 := toy.generate_world(seed=1))["corpus.jsonl"] != toy.generate_world(seed=0)["corpus.jsonl"]
    assert len(seed1["test.jsonl"]) == 400


def test_world_numbers(world_dir):
    stats = toy.world_stats(world_dir)
    assert stats["entities"] == {"person": 120, "film": 80, "city": 60, "country": 15, "company": 40}
    assert stats["bytes"] < 2_000_000 and 90 <= stats["decoys"] <= 130 and stats["hidden"] == 22
    for split, sizes in toy.SPLIT_SIZES.items():
        assert {t: stats[split][t] for t in TYPES} == sizes, split
    assert stats["train"]["total"] > 1000 and all(stats["train"][t] >= 60 for t in TYPES)
    assert 20 <= stats["test"]["unanswerable"] <= 80


def test_popularity_is_per_entity_30_percent(world_dir):
    entities = toy.load_world(str(world_dir))["entities"]
    real = [e for e in entities.values() if not e["decoy_of"]]
    for etype in toy.TYPES:
        of_type = [e for e in real if e["type"] == etype]
        assert sum(e["popular"] for e in of_type) == round(0.3 * len(of_type)), etype
    assert abs(sum(e["popular"] for e in real) / len(real) - 0.3) < 0.01
    assert not any(e["popular"] for e in entities.values() if e["decoy_of"] or e["hidden"])


def test_corpus_triples_and_lengths(world_dir):
    corpus = read_jsonl(world_dir / "corpus.jsonl")
    text_of = {d["id"]: d["contents"] for d in corpus}
    assert max(len(c.split("\n", 1)[1].split()) for c in text_of.values()) <= 20
    triples = read_jsonl(world_dir / "triples.jsonl")
    phrase_rel = {spec[3]: rel for rel, spec in toy.RELATIONS.items()}
    for t in triples:
        assert toy.RELATIONS[phrase_rel[t["relation"]]][2].format(h=t["head"], t=t["tail"]) in text_of[t["doc_id"]]
    rows = load_qa(world_dir / "test.jsonl")
    longest = max(
        len(r["question"].split()) + sum(len(text_of[i].split()) for i in r["metadata"]["supporting_doc_ids"])
        for r in rows
    )
    assert longest <= 100


def test_held_out_facts_never_in_training_questions(world_dir):
    entities = toy.load_world(str(world_dir))["entities"]
    train = load_qa(world_dir / "train.jsonl")
    seen = set().union(*(toy.used_facts(entities, r) for r in train))
    described = {(r["metadata"]["descriptor"], r["question"]) for r in train if r["metadata"]["descriptor"]}
    for split in ("dev", "test"):
        rows = load_qa(world_dir / f"{split}.jsonl")
        held = set().union(*(toy.used_facts(entities, r) for r in rows))
        assert not held & seen, split
        for other, question in described:  # a descriptor "( the director of x )" reveals a fact of x
            rel = next(r for r, spec in toy.RELATIONS.items() if spec[4].format(h=other) in question)
            assert (other, rel) not in held
    popular_test = [r for r in load_qa(world_dir / "test.jsonl") if r["metadata"]["popular"]]
    assert popular_test and all(not toy.used_facts(entities, r) for r in popular_test)


# ---------------------------------------------------------------- baselines (the done-when numbers)


def test_baselines_gold_near_100_no_retrieval_equals_popular_share(world_dir, tables):
    table, hits = tables[str(world_dir)]
    rows = load_qa(world_dir / "test.jsonl")
    popular_share = sum(r["metadata"]["popular"] for r in rows) / len(rows)
    assert table["gold documents"]["answerable"] == 1.0
    assert table["oracle sub-queries, top-1 each"]["answerable"] == 1.0
    assert table["no retrieval"]["all"] == pytest.approx(popular_share)
    assert table["no retrieval"]["one_hop"] == pytest.approx(0.3, abs=0.05)
    assert table["no retrieval"]["not_popular"] == 0.0 and table["no retrieval"]["popular"] == 1.0
    assert table["gold documents"]["unanswerable"] == 0.0


def test_baselines_headroom_for_each_decision(world_dir, tables):
    table, hits = tables[str(world_dir)]
    gold, raw5 = table["gold documents"], table["raw question, top-5"]
    for qtype in ("two_hop", "three_hop"):  # what to retrieve, when to stop: single-shot RAG leaves >= 20 points
        assert gold[qtype] - raw5[qtype] >= 0.20, qtype
        assert gold[qtype] - table["raw question, top-1"][qtype] >= 0.20, qtype
    assert table["raw question, top-1"]["one_hop"] <= gold["one_hop"] - 0.05
    assert hits["oracle first sub-query top-1 hits the first-hop document"] >= 0.99
    assert hits["raw question top-1 hits the first-hop document"] <= 0.85  # descriptors, question words
    assert hits["oracle sub-queries top-1 recall of all supporting documents"] == 1.0
    assert hits["raw question top-5 recall of all supporting documents"] <= 0.8
    assert table["gold documents + distractors after"]["answerable"] <= gold["answerable"] - 0.15  # what to keep


def test_committed_world_baseline_values(tables):
    table, hits = tables[str(COMMITTED)]  # the figures of docs/toy_world.md
    assert table["no retrieval"]["all"] == pytest.approx(0.170, abs=5e-4)
    assert table["gold documents"]["all"] == pytest.approx(0.9225, abs=5e-4)
    assert table["raw question, top-5"]["two_hop"] == pytest.approx(0.409, abs=5e-4)
    assert table["raw question, top-5"]["three_hop"] == pytest.approx(0.229, abs=5e-4)
    assert hits["raw question top-1 hits the first-hop document"] == pytest.approx(0.719, abs=5e-4)


# ---------------------------------------------------------------- the reader


def test_reader_memory_and_unknown():
    reader = toy.ToyReader(COMMITTED)
    rows = load_qa(COMMITTED / "test.jsonl")
    for row in rows:
        pred = reader_answer(reader, row["question"])
        assert (pred == row["golden_answers"][0]) if row["metadata"]["popular"] else pred == "unknown"


def test_reader_is_misled_by_a_near_name_read_last():
    world = toy.load_world(str(COMMITTED))
    ents = world["entities"]
    decoy, target = next(
        (d, e["decoy_of"])
        for d, e in sorted(ents.items())
        if e["decoy_of"] and ents[e["decoy_of"]]["type"] == "film" and not ents[e["decoy_of"]]["popular"]
    )
    true_doc, decoy_doc = toy.passage_text(target, ents[target]), toy.passage_text(decoy, ents[decoy])
    reader = toy.ToyReader(COMMITTED)
    question = toy.CHAINS[("directed_by",)].format(target)
    right, wrong = ents[target]["facts"]["directed_by"], ents[decoy]["facts"]["directed_by"]
    assert right != wrong
    assert reader_answer(reader, question, [true_doc]) == right
    assert reader_answer(reader, question, [decoy_doc, true_doc]) == right
    assert reader_answer(reader, question, [true_doc, decoy_doc]) == wrong  # careless: the last statement wins
    assert reader_answer(reader, question, [decoy_doc]) == wrong
    popular = next(n for n, e in sorted(ents.items()) if e["popular"] and e["type"] == "film" and world["near"][n])
    near = world["near"][popular][0]
    popular_q = toy.CHAINS[("directed_by",)].format(popular)
    assert (
        reader_answer(reader, popular_q, [toy.passage_text(near, ents[near])]) == ents[popular]["facts"]["directed_by"]
    )


def test_reader_finds_the_question_in_paper_prompts_and_wraps_answers():
    reader = toy.ToyReader(COMMITTED)
    row = next(
        r
        for r in load_qa(COMMITTED / "test.jsonl")
        if r["metadata"]["type"] == "two_hop" and r["metadata"]["answerable"] and r["metadata"]["descriptor"]
    )
    docs = [
        {"contents": c["contents"]}
        for c in read_jsonl(COMMITTED / "corpus.jsonl")
        if c["id"] in row["metadata"]["supporting_doc_ids"]
    ]
    other = load_qa(COMMITTED / "train.jsonl")[0]
    c3po = (
        "You are a knowledgeable assistant. Please answer the following question by:\n1. First reviewing the "
        "provided documents.\nHere are some examples:\nQuestion: " + other["question"].capitalize() + "\nAnswer: x"
        "\n\nNow, process the following question:\nExisting documents: "
        + " ".join(d["contents"] for d in docs)
        + "\n\nQuestion: "
        + row["question"].capitalize().replace(" ?", "?")
    )
    sparc = (
        "Answer the question based on the given notes.\nEnd your response with the literal tag [END].\n"
        "The following are given notes:\n"
        + "\n".join(d["contents"] for d in docs)
        + f"\nQuestion: {row['question']}\nAnswer:"
    )
    replies = reader.chat(
        [
            [{"role": "user", "content": c3po}],
            [{"role": "system", "content": "be short"}, {"role": "user", "content": sparc}],
        ],
        temperature=1.0,
    )
    assert replies == [row["golden_answers"][0], row["golden_answers"][0] + " [END]"]
    select = f"Question: {row['question']}\nprovide the answer inside <answer> </answer> tags."
    assert reader.chat([[{"role": "user", "content": select}]]) == ["<answer> unknown </answer>"]


def test_reader_think_mode_walks_the_chain_one_step_per_call():
    reader = toy.ToyReader(COMMITTED)
    row = next(
        r
        for r in load_qa(COMMITTED / "test.jsonl")
        if r["metadata"]["type"] == "three_hop"
        and r["metadata"]["answerable"]
        and not any(r["metadata"]["popular_hops"])
    )
    text_of = {c["id"]: c["contents"] for c in read_jsonl(COMMITTED / "corpus.jsonl")}
    instruction = (
        "Please answer the following question. You should think step-by-step to solve it. Each thought "
        "should be put inside <think> and </think> tags; put your final answer inside <answer> and </answer>."
        "\nContext:\n{context}\n\nQuestion: {question}"
    )
    context, thoughts, steps = [], "", []
    for _ in range(10):
        messages = [
            {"role": "user", "content": instruction.format(context="\n".join(context), question=row["question"])}
        ]
        reply = reader.chat([messages + ([{"role": "assistant", "content": thoughts}] if thoughts else [])])[0]
        steps.append(reply)
        if reply.startswith("<answer>"):
            break
        thoughts += reply + "\n"
        if "i need to know" in reply:  # the retrieval a method would do: the next supporting document
            context.append(text_of[row["metadata"]["supporting_doc_ids"][len(context)]])
    m = row["metadata"]
    assert (
        steps[0]
        == f"<think> i need to know {toy.RELATIONS[m['relations'][0]][4].format(h=m['entities'][0])} . </think>"
    )
    assert len(steps) == 7 and steps[-1] == f"<answer> {row['golden_answers'][0]} </answer>"
    assert sum("i need to know" in s for s in steps) == 3
    stuck = instruction.format(context="", question=row["question"])
    need = steps[0][len("<think> ") : -len(" </think>")]
    history = f"<think> {need} </think>\n" * 2
    assert reader.chat([[{"role": "user", "content": stuck}, {"role": "assistant", "content": history}]]) == [
        "<answer> unknown </answer>"
    ]


def test_reader_plan_mode():
    reader = toy.ToyReader(COMMITTED)
    rows = load_qa(COMMITTED / "test.jsonl")
    row = next(r for r in rows if r["metadata"]["type"] == "three_hop" and not r["metadata"]["popular_hops"][0])
    roadmap = (
        "You are an expert assistant tasked with analyzing the following question and formulating a detailed "
        f"plan.\n\nNow, process the following question:\nQuestion: {row['question']}"
    )
    lines = reader.chat([[{"role": "user", "content": roadmap}]])[0].split("\n")
    first = row["metadata"]["entities"][0]
    assert (
        len(lines) == 4
        and lines[0] == f"step 1 : find {toy.RELATIONS[row['metadata']['relations'][0]][4].format(h=first)} ."
    )
    assert lines[1].endswith(f"of {first} .") and lines[-1] == "step 4 : answer the question ."
    comparison = next(r for r in rows if r["metadata"]["type"] == "yes_no")
    lines = reader.chat([[{"role": "user", "content": "write a plan . question : " + comparison["question"]}]])[0]
    assert lines.split("\n")[-2:] == ["step 3 : compare the two years .", "step 4 : answer the question ."]


def test_make_llm_toy_backend():
    from common.models import make_llm

    llm = make_llm("toy")
    row = next(r for r in load_qa(COMMITTED / "test.jsonl") if r["metadata"]["popular"])
    assert llm.chat([[{"role": "user", "content": row["question"]}]]) == row["golden_answers"]


# ---------------------------------------------------------------- renaming augmentation


def test_rename_entities_consistent_typed_and_answer_preserving():
    world = toy.load_world(str(COMMITTED))
    reader = toy.ToyReader(COMMITTED)
    text_of = {c["id"]: c["contents"].split("\n", 1)[1] for c in read_jsonl(COMMITTED / "corpus.jsonl")}
    rows = [r for r in load_qa(COMMITTED / "train.jsonl") if r["metadata"]["answerable"]][:200]
    rng = random.Random(0)
    changed = 0
    for row in rows:
        docs = [text_of[i] for i in row["metadata"]["supporting_doc_ids"]]
        texts = [row["question"], " ".join(row["metadata"]["sub_queries"]), *docs, row["golden_answers"][0]]
        renamed = toy.rename_entities(texts, world, rng)
        q, _, *new_docs, answer = renamed
        changed += renamed != texts
        old_words, new_words = [t.split() for t in texts], [t.split() for t in renamed]
        mapping = {}
        for ow, nw in zip(old_words, new_words):
            assert len(ow) == len(nw)
            for a, b in zip(ow, nw):
                assert mapping.setdefault(a, b) == b  # consistent across all texts
        assert len(set(mapping.values())) == len(mapping)  # injective
        for a, b in mapping.items():
            if a != b and a in world["types"]:
                assert (
                    world["types"][b] == world["types"][a] and b not in world["popular"] and a not in world["popular"]
                )
        years = sorted((a, b) for a, b in mapping.items() if a.isdigit())
        assert [b for _, b in years] == sorted(b for _, b in years)  # order kept: comparisons keep their answers
        assert reader_answer(reader, q, new_docs) == answer
    assert changed >= 150
    star = sorted(world["popular_pools"]["person"])[0]
    for mode, pool in (
        ("keep", {star}),
        ("shuffle", set(world["popular_pools"]["person"])),
        ("rename", set(world["pools"]["person"])),
    ):
        new = toy.rename_entities([f"{star} was born in 1931 ."], world, random.Random(1), popular=mode)[0].split()
        assert new[0] in pool and (new[4] == "1931") == (mode == "keep")
    founder_q = next(
        r
        for r in load_qa(COMMITTED / "train.jsonl")
        if r["metadata"]["type"] == "one_hop"
        and r["metadata"]["answerable"]
        and not r["metadata"]["popular"]
        and r["golden_answers"][0] in world["popular"]
    )  # a popular answer to copy out of a passage
    head, answer = founder_q["metadata"]["entities"][0], founder_q["golden_answers"][0]
    texts = [founder_q["question"], text_of[founder_q["metadata"]["supporting_doc_ids"][0]], answer]
    seen_popular = 0
    for seed in range(40):  # "free": the searched head goes to a non-popular name, the answer to any name of its type
        q, doc, new_answer = toy.rename_entities(texts, world, random.Random(seed), popular="free", searched=[head])
        new_head = q.split()[founder_q["question"].split().index(head)]
        assert new_head not in world["popular"] and world["types"].get(new_head) == world["types"][head]
        assert world["types"][new_answer] == world["types"][answer] and new_answer in doc.split()
        assert reader_answer(reader, q, [doc]) == new_answer
        seen_popular += new_answer in world["popular"]
    assert 0 < seen_popular < 40
    with pytest.raises(ValueError, match="popular must be"):
        toy.rename_entities(["x"], world, rng, popular="all")
    assert toy.rename_entities(["question : who is it ?", "[SEARCH] 12 <think>"], world, rng) == [
        "question : who is it ?",
        "[SEARCH] 12 <think>",
    ]


# ---------------------------------------------------------------- tiny model and tokenizer


def test_tokenizer_single_tokens_and_chat_template():
    from common.toy.lm import load_toy_lm, toy_vocabulary

    world = toy.load_world(str(COMMITTED))
    model, tok = load_toy_lm("toy-lm", extra_tokens=("[Search]", "<think>", "</think>"), world=COMMITTED)
    words = toy_vocabulary(world)
    assert set(world["types"]) <= set(words) and {"1900", "1999", "question", "answer", ":", "?"} <= set(words)
    ids = tok(" ".join(words), add_special_tokens=False)["input_ids"]
    assert len(ids) == len(words) and tok.unk_token_id not in ids
    assert tok.decode(ids) == " ".join(words)
    extra = tok("[Search] zorvak <think> ok </think>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(extra)[0] == "[Search]" and len(extra) == 5
    assert tok.decode(extra, skip_special_tokens=True).startswith("[Search]")
    assert tok("Question: Who?")["input_ids"] == tok("question : who ?")["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "who ?"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<user> who ? <eos> <assistant>" and tok.padding_side == "left"
    assert len(tok(chat, add_special_tokens=False)["input_ids"]) == 5


def test_tiny_model_builds_fast_and_round_trips(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.toy.lm import load_toy_lm

    start = time.time()
    model, tok = load_toy_lm("toy-lm", extra_tokens=("[Search]",), seed=0, world=COMMITTED)
    assert time.time() - start < 2.0
    assert type(model).__name__ == "Qwen2ForCausalLM" and 0.5e6 < model.num_parameters() < 0.8e6
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2, tok2 = AutoModelForCausalLM.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    text = "question : who is the director of zorvak ? [Search] zorvak directed"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"] and tok2.padding_side == "left"
    x = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2(x).logits)
    again, _ = load_toy_lm("toy-lm", extra_tokens=("[Search]",), seed=0, world=COMMITTED)
    other, _ = load_toy_lm("toy-lm", extra_tokens=("[Search]",), seed=1, world=COMMITTED)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    big, _ = load_toy_lm("toy-lm:layers=4,hidden=64,heads=2,kv_heads=2,intermediate=256", world=COMMITTED)
    assert big.config.num_hidden_layers == 4 and big.config.hidden_size == 64
    with pytest.raises(ValueError, match="bad toy model option"):
        load_toy_lm("toy-lm:layers=two", world=COMMITTED)


def test_model_loader_delegates_and_lora():
    from common.models import load_model_and_tokenizer

    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    model, tok = load_model_and_tokenizer("toy-lm:layers=1", lora=lora, world=COMMITTED)
    assert type(model).__name__ == "PeftModelForCausalLM" and tok.padding_side == "left"
    assert re.search(r"lora_A", " ".join(n for n, _ in model.named_parameters()))


TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"


def world_texts(world_dir):
    """Every text of a world a model reads or writes: passages, questions, gold answers and oracle sub-queries."""
    texts = [c["contents"] for c in read_jsonl(world_dir / "corpus.jsonl")]
    for split in ("train", "dev", "test"):
        for row in load_qa(world_dir / f"{split}.jsonl"):
            texts += [row["question"], *row["golden_answers"], *row["metadata"]["sub_queries"]]
    return texts


def unk_count(tokenizer, texts):
    """How many tokens of the texts are <unk>."""
    return sum(ids.count(tokenizer.unk_token_id) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("which", ["seed 3, size 0.3", "seed 1"])
def test_the_tokenizer_of_a_world_knows_every_word_of_it(which, seed1_world, tmp_path):
    from common.models import load_model_and_tokenizer

    world_dir = toy.write_world(tmp_path, seed=3, size=0.3) if which.startswith("seed 3") else seed1_world
    texts = world_texts(world_dir)
    _, tokenizer = load_model_and_tokenizer(TINY_LM, world=world_dir)
    assert len(texts) > 1000 and unk_count(tokenizer, texts) == 0
    _, committed = load_model_and_tokenizer(TINY_LM, world=COMMITTED)  # the committed world's vocabulary
    assert unk_count(committed, texts) > 100


def test_a_checkpoint_keeps_the_vocabulary_of_its_world(seed1_world, tmp_path):
    from common.llm import unknown_words
    from common.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(TINY_LM, world=seed1_world)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _, loaded = load_model_and_tokenizer(tmp_path, world=COMMITTED)  # a folder loads its own tokenizer
    _, committed = load_model_and_tokenizer(TINY_LM, world=COMMITTED)
    assert loaded.get_vocab() == tokenizer.get_vocab() != committed.get_vocab()
    question = load_qa(seed1_world / "test.jsonl")[0]["question"]
    assert unknown_words(loaded, question) == [] and unknown_words(loaded, question + " Zzyzx") == ["Zzyzx"]


def test_the_reader_remembers_the_popular_facts_of_its_own_world(seed1_world):
    from common.models import make_llm

    reader, committed = make_llm(f"toy:{seed1_world}"), toy.ToyReader(COMMITTED)
    world, committed_names = toy.load_world(str(seed1_world)), toy.load_world(str(COMMITTED))["types"]
    assert set(reader.world["memory"]) == {(n, r) for n in world["popular"] for r in world["entities"][n]["facts"]}
    row = next(
        r
        for r in load_qa(seed1_world / "test.jsonl")
        if r["metadata"]["popular"]
        and r["metadata"]["type"] == "one_hop"
        and r["metadata"]["entities"][0] not in committed_names
    )
    assert reader_answer(reader, row["question"]) == row["golden_answers"][0]  # no documents: from memory
    assert reader_answer(committed, row["question"]) == "unknown"  # data/toy's reader knows nothing of this world
    other = next(
        r
        for r in load_qa(COMMITTED / "test.jsonl")
        if r["metadata"]["popular"] and r["metadata"]["entities"][0] not in world["types"]
    )
    assert reader_answer(committed, other["question"]) == other["golden_answers"][0]
    assert reader_answer(reader, other["question"]) == "unknown"


def test_whatever_reads_a_world_takes_its_folder():
    import inspect

    for function in (toy.load_world, toy.ToyReader, toy.baselines, toy.world_stats):
        world_dir = inspect.signature(function).parameters["world_dir"]
        assert world_dir.default is inspect.Parameter.empty, f"{function.__name__} defaults to a world"


def test_model_code_imports_the_toy_world_not_the_reverse():
    """common.llm never imports the toy world, not even lazily; common.toy.lm is built on the toy world; common.models,
    the one place that knows every backend, imports common.llm at module level and the toy world only when a toy
    name or spec is asked for; no other common module imports any of them; inside common/toy/, the reader reads the
    world, each method's toy module (its oracle teacher, renaming, warm-up) reads the world (and the reader), and
    nothing imports common.llm or common.models."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    common, edges = Path(toy.__file__).parent.parent, {}
    names = {"llm": "llm", "models": "models", "toy": "toy", "toy.lm": "lm", "toy.world": "world"}
    names |= {"toy.reader": "reader"}
    paths = sorted(common.glob("*.py")) + sorted(common.glob("toy/*.py"))
    for path in paths:
        stem = path.stem if path.parent == common else f"toy/{path.stem}"
        for statement in ast.parse(path.read_text(encoding="utf-8")).body:
            where = getattr(statement, "name", "")  # the top-level function holding a lazy import, "" at module level
            for node in ast.walk(statement):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    modules = [node.module] + [f"common.{a.name}" for a in node.names if node.module == "common"]
                for target in {names.get(m[len("common.") :]) for m in modules if m.startswith("common.")} - {None}:
                    edges.setdefault((stem, target), set()).add(where)
    assert {"llm", "models", "runs", "toy/__init__", "toy/lm", "toy/world"} <= {
        p.stem if p.parent == common else f"toy/{p.stem}" for p in paths
    }  # all were read
    assert edges == {
        ("toy/lm", "world"): {""},  # the model's vocabulary is its world's
        ("toy/reader", "world"): {""},
        ("toy/smartrag", "reader"): {""},  # each method's toy side (oracle, renaming, warm-up): world and reader
        ("toy/smartrag", "world"): {""},
        ("toy/c3po", "world"): {""},
        ("toy/sparkle", "world"): {""},
        ("toy/tearag", "world"): {""},
        ("toy/sparcrag", "world"): {""},
        ("toy/__init__", "reader"): {""},  # the package's names as one module
        ("toy/__init__", "world"): {""},
        ("toy/__main__", "toy"): {""},
        ("models", "llm"): {""},  # hub ids, folders, endpoints
        ("models", "lm"): {"load_model_and_tokenizer"},  # the "toy-lm" name, imported when asked for
        ("models", "toy"): {"make_llm"},  # the "toy" LLM spec, likewise
    }
    toy_first = (
        "import sys, common.toy\n"
        "assert not {'torch', 'transformers', 'common.llm', 'common.toy.lm'} & set(sys.modules)\n"
        "import common.toy.lm\nassert not {'common.llm', 'common.models'} & set(sys.modules)"
    )
    models_first = "import sys, common.models\nassert not {'common.toy', 'common.toy.lm'} & set(sys.modules)"
    for code in (toy_first, models_first):  # each in a fresh interpreter
        out = subprocess.run([sys.executable, "-c", code], cwd=common.parent, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]


def test_cli_writes_a_world(tmp_path, capsys):
    toy.main(["--seed", "2", "--out", str(tmp_path / "w"), "--size", "0.5"])
    stats = json.loads(capsys.readouterr().out)
    assert stats["entities"]["person"] == 60 and (tmp_path / "w" / "world.json").is_file()


def test_world_renaming_is_a_typed_bijection_sending_searched_names_to_non_popular_ones():
    world = toy.load_world(str(COMMITTED))
    star = sorted(world["popular_pools"]["person"])[0]
    for seed in range(5):
        forward, inverse = toy.world_renaming(world, random.Random(seed), searched=[star])
        assert set(forward) == set(world["types"]) == set(forward.values())  # every name, onto every name
        assert all(inverse[forward[n]] == n and world["types"][forward[n]] == world["types"][n] for n in forward)
        assert forward[star] in world["pools"]["person"]  # a searched popular name becomes a non-popular one
    assert toy.world_renaming(world, random.Random(3), [star]) == toy.world_renaming(world, random.Random(3), [star])
    text = f"{star} was born in 1931 ."
    assert toy.apply_mapping(toy.apply_mapping([text], forward), inverse) == [text]  # years kept, round trip exact


# ---------------------------------------------------------------- the RL side of renaming, and the oracle teachers


def one_hop_row(rows=None):
    """A not-popular, answerable one-hop training question of the committed world."""
    rows = rows or load_qa(COMMITTED / "train.jsonl")
    return next(
        r
        for r in rows
        if r["metadata"]["type"] == "one_hop" and r["metadata"]["answerable"] and not r["metadata"]["popular"]
    )


class RecordingRetriever:
    """search(queries, k): one hit per query naming its first word, recording what it was sent."""

    def __init__(self):
        self.calls = []

    def search(self, queries, k):
        self.calls.append((list(queries), k))
        hit = lambda q: {"id": "7", "title": q.split()[0], "text": f"{q} here .", "contents": f'"{q}"\n{q} here .'}
        return [[dict(hit(q), score=0.5)] for q in queries]


class RecordingLLM:
    """chat(messages_lists, **sampling): replies with the last message's content, recording what it was sent."""

    def __init__(self):
        self.calls = []

    def chat(self, messages_lists, **sampling):
        self.calls.append((messages_lists, sampling))
        return [f"{m[-1]['content']} ." for m in messages_lists]


def test_a_renamed_row_searches_in_real_names_and_reads_renamed_documents():
    world = toy.load_world(str(COMMITTED))
    row = one_hop_row()
    renamed = toy.renamed_row(row, world, random.Random(0))
    forward, inverse = renamed["rename"]
    head, query = row["metadata"]["entities"][0], row["metadata"]["sub_queries"][0]
    assert forward[head] != head and inverse[forward[head]] == head
    seen = toy.apply_mapping([query], forward)[0]  # the query as the policy writes it, in the row's names
    plain = {"question": "who ?", "golden_answers": ["x"], "metadata": {}}
    retriever = RecordingRetriever()
    env = toy.RenamingEnv(retriever)
    found = env.search([seen, query], 1, [renamed, plain])
    assert retriever.calls == [([query, query], 1)]  # both reach the corpus in real names
    real = retriever.search([query], 1)[0]
    assert found[1] == real  # an unrenamed row passes through unchanged
    [hit] = found[0]
    assert (
        hit["title"] == forward[head]
        and hit["text"] == f"{seen} here ."
        and hit["contents"] == f'"{seen}"\n{seen} here .'
    )
    assert hit["id"] == "7" and hit["score"] == 0.5  # only the texts are renamed
    assert head not in " ".join((hit["title"], hit["text"], hit["contents"])).split()
    assert env.search([], 1, []) == []


def test_a_renamed_row_chats_in_real_names_and_reads_renamed_replies():
    world = toy.load_world(str(COMMITTED))
    row = one_hop_row()
    renamed = toy.renamed_row(row, world, random.Random(1))
    forward, _ = renamed["rename"]
    llm = RecordingLLM()
    env = toy.RenamingEnv(RecordingRetriever(), llm)
    system = {"role": "system", "content": "be short"}
    asked = [[system, {"role": "user", "content": renamed["question"]}], [{"role": "user", "content": "who ? x"}]]
    plain = {"question": "who ? x", "golden_answers": ["x"], "metadata": {}}
    replies = env.chat(asked, [renamed, plain], temperature=0.3, max_tokens=7)
    [(sent, sampling)] = llm.calls
    assert sampling == {"temperature": 0.3, "max_tokens": 7}
    assert sent == [[system, {"role": "user", "content": row["question"]}], asked[1]]  # real names, roles kept
    assert replies == [f"{renamed['question']} .", "who ? x ."]  # the reply comes forward; the plain one unchanged
    assert renamed["question"] != row["question"]
    assert env.chat([], [], temperature=0.0) == [] and len(llm.calls) == 1  # nothing to ask: no call


def test_rename_rows_renames_only_with_a_world_and_keeps_popular_rows():
    world = toy.load_world(str(COMMITTED))
    rows = load_qa(COMMITTED / "train.jsonl")[:40]
    assert any(r["metadata"]["popular"] for r in rows) and not all(r["metadata"]["popular"] for r in rows)
    assert all(a is b for a, b in zip(toy.rename_rows(rows, None, random.Random(0), 1.0), rows))
    assert all(a is b for a, b in zip(toy.rename_rows(rows, world, random.Random(0), 0.0), rows))
    every = toy.rename_rows(rows, world, random.Random(0), 1.0)
    for before, after in zip(rows, every):
        assert (
            (after is before) if before["metadata"]["popular"] else ("rename" in after and after["id"] == before["id"])
        )
    some = toy.rename_rows(rows, world, random.Random(0), 0.5)
    renamed = [r for r in some if "rename" in r]
    assert 0 < len(renamed) < sum(not r["metadata"]["popular"] for r in rows)
    again = toy.rename_rows(rows, world, random.Random(0), 0.5)
    assert [r["question"] for r in again] == [r["question"] for r in some]  # seeded


def test_world_or_none(tmp_path):
    assert toy.world_or_none(str(COMMITTED)) is toy.load_world(str(COMMITTED))  # the cached world (--data_dir)
    assert toy.world_or_none(COMMITTED)["entities"] == toy.load_world(str(COMMITTED))["entities"]
    assert toy.world_or_none(tmp_path) is None  # real data: no world, no renaming


def oracle_row(qtype="two_hop", popular_hops=(False, False)):
    """A hand-made question: zekil -directed_by-> mipon -born_in-> tuvia (comparison: zekil vs mipon)."""
    entities = ["zekil", "mipon", "tuvia"] if qtype != "one_hop" else ["zekil", "mipon"]
    hops = len(entities) - 1 if qtype != "comparison" else 2
    meta = dict(type=qtype, hops=hops, entities=entities, popular=all(popular_hops), popular_hops=list(popular_hops),
                sub_queries=["zekil directed", "mipon born"][:hops])  # fmt: skip
    return {"question": "q ?", "golden_answers": [entities[-1]], "metadata": meta}


def oracle(row, agent, ctx=None, prefix="", noise=0.0):
    base = dict(docs=[], acc=[], used={}, forced=False)
    from common.toy.c3po import oracle_c3po

    return oracle_c3po(row, agent, base | (ctx or {}), prefix, random.Random(0), noise)


def test_oracle_c3po_router():
    assert oracle(oracle_row(), "router") == "[Planning]"
    assert oracle(oracle_row("one_hop", (False,)), "router") == "[Retrieval] zekil directed"
    assert oracle(oracle_row("one_hop", (True,)), "router") == "[No Retrieval]"
    assert oracle(oracle_row(popular_hops=(True, True)), "router") == "[No Retrieval]"
    assert oracle(oracle_row(), "router", prefix="[Retrieval]") == " zekil directed"  # the forced root's query
    assert oracle(oracle_row(), "router", noise=1.0) == "[Planning]"  # noise misleads the filter and the DM only


def test_oracle_c3po_filter_keeps_the_hop_documents_unless_noisy():
    docs = [{"title": "zekil"}, {"title": "zekel"}, {"title": "mipon"}, {"title": "tuvia"}]  # tuvia: the answer
    assert oracle(oracle_row(), "filter", {"docs": docs}) == "Thought: keep 1, 3 .\nAction: [1, 3]"
    assert (
        oracle(oracle_row(), "filter", {"docs": docs}, noise=1.0) == "Thought: keep 1, 2, 3, 4 .\nAction: [1, 2, 3, 4]"
    )
    assert oracle(oracle_row(), "filter", {"docs": docs[1:2]}) == "Thought: none relevant .\nAction: []"
    comparison = oracle_row("comparison")  # heads: the two compared entities
    assert oracle(comparison, "filter", {"docs": docs}) == "Thought: keep 1, 3 .\nAction: [1, 3]"


def test_oracle_c3po_decision_maker_asks_for_the_next_missing_hop():
    row, zekil, mipon = oracle_row(), {"title": "zekil"}, {"title": "mipon"}
    step = lambda n, q: f"Thought: need step {n} .\nAction: [Retrieval] {q}"
    done = "Thought: done .\nAction: [LLM]"
    assert oracle(row, "dm") == step(1, "zekil directed")
    assert oracle(row, "dm", {"acc": [zekil]}) == step(2, "mipon born")
    assert oracle(row, "dm", {"acc": [zekil, mipon]}) == done
    assert oracle(row, "dm", {"acc": [zekil], "used": {"mipon born": 1}}) == done  # asked already: no repeat
    assert oracle(oracle_row(popular_hops=(True, False)), "dm") == step(2, "mipon born")  # memory: no retrieval
    assert oracle(row, "dm", {"forced": True}) == done
    assert oracle(row, "dm", noise=1.0) == done  # noise: stops early
