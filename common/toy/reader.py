"""The toy reader (a frozen LLM that knows the popular facts and reads the rest), its reasoning variant and the
baselines of a world."""

import re
from collections import Counter, defaultdict
from pathlib import Path

from common.toy.world import (
    CHAINS,
    COMPARISONS,
    CONFIDENCE_WORDS,
    NOTE_WORDS,
    PLAN_WORDS,
    RELATIONS,
    UNKNOWN,
    load_world,
)

# ---------------------------------------------------------------- the toy reader

FACT_PATTERNS = []  # (compiled regex with head/tail groups, candidate relations), built from RELATIONS
for _sentence in dict.fromkeys(spec[2] for spec in RELATIONS.values()):
    _regex = re.escape(_sentence[:-2]).replace(r"\{h\}", r"\b([a-z]+)").replace(r"\{t\}", r"([a-z0-9]+)\b")
    FACT_PATTERNS.append(
        (re.compile(_regex.replace(r"\ ", r"\s+")), [r for r, spec in RELATIONS.items() if spec[2] == _sentence])
    )
TRIPLE_PATTERN = re.compile(r"<\s*([a-z]+)\s*;\s*([a-z ]+?)\s*;\s*([a-z0-9]+)\s*>")
PHRASE_RELATIONS = {spec[3]: rel for rel, spec in RELATIONS.items()}


def question_patterns():
    """(compiled regex, kind, relations) for every question template, entity slots as ([a-z]+) groups."""
    out = []
    templates = [(t, "chain", list(rels)) for rels, t in CHAINS.items()]
    templates += [(t, kind, [rel, rel]) for (kind, rel), t in COMPARISONS.items()]
    for template, kind, rels in templates:
        regex = re.escape(template).replace(r"\{0\}", r"([a-z]+)").replace(r"\{1\}", r"([a-z]+)")
        out.append((re.compile(r"\b" + regex.replace(r"\ ", r"\s+")), kind, rels))
    return out


QUESTION_PATTERNS = question_patterns()


class ToyReader:
    """The toy world's frozen LLM: deterministic, reads toy facts in its prompt plus a memory of popular entities.
    See the module docstring for the protocol (question finding, fact reading, careless lookup, the three modes)."""

    def __init__(self, world_dir, **_):
        self.world = load_world(str(world_dir))

    def chat(self, messages_lists, stop=None, **_sampling):
        """One reply per conversation (list of {"role", "content"}); sampling arguments are ignored. In think mode a
        `stop` without "</think>" (given, and not None) asks for every step at once."""
        stepwise = stop is None or "</think>" in ([stop] if isinstance(stop, str) else list(stop))
        return [self.reply("\n".join(m["content"] for m in messages), stepwise) for messages in messages_lists]

    def reply(self, prompt, stepwise=True):
        """The reply to one prompt text."""
        text = prompt.lower()
        question = self.find_question(text)
        if "<think>" in text:
            steps = [self.think(text, question)]
            while not stepwise and not steps[-1].startswith("<answer>"):  # ends: a link repeats at most twice
                steps.append(self.think(text + "\n" + "\n".join(steps), question))
            return "\n".join(steps)
        if PLAN_WORDS.search(text):
            return self.plan(text, question)
        if NOTE_WORDS.search(text):
            return self.note(text, question) + (" [END]" if "[end]" in text else "")
        answer = self.answer(self.read_facts(text), question) if question else UNKNOWN
        if CONFIDENCE_WORDS.search(text):
            answer = "0.0" if answer == UNKNOWN else "1.0"
        answer = f"<answer> {answer} </answer>" if "<answer>" in text else answer
        return answer + " [END]" if "[end]" in text else answer

    def find_question(self, text):
        """(kind, relations, entities) of the last question template matched in the text, or None."""
        flat = re.sub(r"\s*\([^()]*\)", "", text)
        flat = re.sub(r"\s*([?,])\s*", r" \1 ", flat)
        best = None
        for pattern, kind, rels in QUESTION_PATTERNS:
            for m in pattern.finditer(flat):
                names = m.groups()
                wanted = [RELATIONS[rels[0]][0]] * len(names)
                if [self.world["types"].get(n) for n in names] == wanted and (best is None or m.end() > best[0]):
                    best = (m.end(), kind, rels, names)
        return best[1:] if best else None

    def read_facts(self, text):
        """Every (head, relation, tail) stated in the text, in order of appearance."""
        found = []
        for pattern, rels in FACT_PATTERNS:
            for m in pattern.finditer(text):
                found += [
                    (m.start(), h, r, t)
                    for h, r, t in [(m.group(1), None, m.group(2))]
                    for r in [self.relation_of(rels, h, t)]
                    if r
                ]
        for m in TRIPLE_PATTERN.finditer(text):
            rel = PHRASE_RELATIONS.get(" ".join(m.group(2).split()))
            if rel and self.relation_of([rel], m.group(1), m.group(3)):
                found.append((m.start(), m.group(1), rel, m.group(3)))
        return [f[1:] for f in sorted(found)]

    def relation_of(self, rels, head, tail):
        """The relation among rels that the head and tail types fit, or None."""
        types = self.world["types"]
        for rel in rels:
            h_type, t_type = RELATIONS[rel][:2]
            tail_ok = tail.isdigit() if t_type == "year" else types.get(tail) == t_type
            if types.get(head) == h_type and tail_ok:
                return rel
        return None

    def lookup(self, facts, entity, rel):
        """The tail the reader believes for (entity, rel): see the careless rule in the module docstring."""
        if entity in self.world["popular"]:
            exact = [t for h, r, t in facts if h == entity and r == rel]
            return exact[-1] if exact else self.world["memory"].get((entity, rel))
        names = {entity, *self.world["near"].get(entity, ())}
        said = [t for h, r, t in facts if h in names and r == rel]
        return said[-1] if said else None

    def links(self, facts, question):
        """[(head, relation, believed tail or None)] along the question, stopping after the first unknown."""
        kind, rels, names = question
        out = []
        if kind == "chain":
            head = names[0]
            for rel in rels:
                tail = self.lookup(facts, head, rel)
                out.append((head, rel, tail))
                if tail is None:
                    break
                head = tail
        else:
            for name in names:
                out.append((name, rels[0], self.lookup(facts, name, rels[0])))
        return out

    def answer(self, facts, question):
        """The short answer to a question given the facts, or UNKNOWN."""
        kind, rels, names = question
        links = self.links(facts, question)
        if any(t is None for _, _, t in links):
            return UNKNOWN
        if kind == "chain":
            return links[-1][2]
        first = int(links[0][2]) < int(links[1][2])
        return ("yes" if first else "no") if kind == "yes_no" else (names[0] if first else names[1])

    def think(self, text, question):
        """One reasoning step: the next link stated, the missing one asked for, or the final <answer>."""
        if not question:
            return f"<answer> {UNKNOWN} </answer>"
        facts = self.read_facts(text)
        thoughts = " ".join(re.findall(r"<think>(.*?)</think>", text, flags=re.S))
        stated = {(h, r) for h, r, _ in self.read_facts(thoughts)}
        for head, rel, tail in self.links(facts, question):
            if tail is None:
                need = f"i need to know {RELATIONS[rel][4].format(h=head)} ."
                if thoughts.count(need) >= 2:
                    return f"<answer> {UNKNOWN} </answer>"
                asked = f"<search> {need} </search>" if "<search>" in text else need
                return f"<think> {asked} </think>"
            if (head, rel) not in stated:
                return f"<think> {RELATIONS[rel][2].format(h=head, t=tail)} </think>"
        return f"<answer> {self.answer(facts, question)} </answer>"

    def note(self, text, question):
        """A query-aware note: the statements of the text along the question's links, exact names, each once."""
        if not question:
            return ""
        kind, rels, names = question
        said = {(h, r): t for h, r, t in self.read_facts(text)}  # the most recent statement of each fact
        kept = []
        if kind == "chain":
            head = names[0]
            for rel in rels:
                tail = said.get((head, rel))
                if tail is not None:
                    kept.append((head, rel, tail))
                elif head in self.world["popular"]:  # followed through memory, not written
                    tail = self.world["memory"].get((head, rel))
                if tail is None:
                    break
                head = tail
        else:
            kept = [(n, rels[0], said[(n, rels[0])]) for n in names if (n, rels[0]) in said]
        return " ".join(RELATIONS[r][2].format(h=h, t=t) for h, r, t in kept)

    def plan(self, text, question):
        """A roadmap: one 'step i : find ... .' line per needed fact, then 'step n : answer the question .'."""
        if not question:
            return "step 1 : answer the question ."
        kind, rels, names = question
        facts = self.read_facts(text)
        goals = []
        if kind == "chain":
            head, known = names[0], True
            for rel in rels:
                goals.append(RELATIONS[rel][4].format(h=head))
                tail = self.lookup(facts, head, rel) if known else None
                known = tail is not None
                head = tail if known else goals[-1]
        else:
            goals = [RELATIONS[rels[0]][4].format(h=n) for n in names]
        lines = [f"step {i} : find {g} ." for i, g in enumerate(goals, 1)]
        if kind != "chain":
            lines.append(f"step {len(lines) + 1} : compare the two years .")
        lines.append(f"step {len(lines) + 1} : answer the question .")
        return "\n".join(lines)


# ---------------------------------------------------------------- baselines


def reader_prompt(question, docs):
    """The prompt the baselines give the toy reader: documents then the question."""
    lines = ["answer the question using the documents ."] + [f"document : {d['contents']}" for d in docs]
    return "\n".join(lines + [f"question : {question}"])


def evaluate_reader(reader, rows, docs_per_row):
    """EM of the reader with the given documents per row: {"all", "answerable", <type>...} -> mean EM."""
    from common.metrics import exact_match

    prompts = [[{"role": "user", "content": reader_prompt(r["question"], d)}] for r, d in zip(rows, docs_per_row)]
    preds = reader.chat(prompts)
    groups = defaultdict(list)
    for row, pred in zip(rows, preds):
        em = exact_match(pred, row["golden_answers"])
        m = row["metadata"]
        for key in (
            "all",
            m["type"],
            "answerable" if m["answerable"] else "unanswerable",
            "popular" if m["popular"] else "not_popular",
            "multi_hop" if m["hops"] > 1 else "single_hop",
        ):
            groups[key].append(em)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def baselines(world_dir, split="test"):
    """The baseline table: {setting: {group: EM}} plus retrieval hit rates {name: rate}."""
    from common.data import load_qa
    from common.retrieval import DenseRetriever, load_corpus, make_encoder

    world_dir = Path(world_dir)
    rows = load_qa(world_dir / f"{split}.jsonl")
    corpus = load_corpus(world_dir / "corpus.jsonl")
    by_id = {d["id"]: d for d in corpus}
    retriever = DenseRetriever.build(corpus, make_encoder("tfidf"))
    reader = ToyReader(world_dir)
    raw = retriever.search([r["question"] for r in rows], 5)
    subs = [q for r in rows for q in r["metadata"]["sub_queries"]]
    sub_hits = iter(retriever.search(subs, 1))
    oracle = [[next(sub_hits)[0] for _ in r["metadata"]["sub_queries"]] for r in rows]
    gold = [[by_id[i] for i in r["metadata"]["supporting_doc_ids"]] for r in rows]
    distract = [[by_id[i] for i in r["metadata"]["distractor_doc_ids"]] for r in rows]
    settings = {
        "no retrieval": [[] for _ in rows],
        "gold documents": gold,
        "raw question, top-1": [h[:1] for h in raw],
        "raw question, top-3": [h[:3] for h in raw],
        "raw question, top-5": raw,
        "oracle sub-queries, top-1 each": oracle,
        "gold documents + distractors after": [g + d for g, d in zip(gold, distract)],
    }
    table = {name: evaluate_reader(reader, rows, docs) for name, docs in settings.items()}
    doc_of = {d["title"]: d["id"] for d in corpus}
    first_gold = [
        [doc_of[r["metadata"]["entities"][0]]] if r["metadata"]["entities"][0] in doc_of else [] for r in rows
    ]
    hits = {
        "raw question top-1 hits the first-hop document": rate(first_gold, [h[:1] for h in raw]),
        "oracle first sub-query top-1 hits the first-hop document": rate(first_gold, [o[:1] for o in oracle]),
        "raw question top-5 recall of all supporting documents": recall(rows, raw),
        "oracle sub-queries top-1 recall of all supporting documents": recall(rows, oracle),
    }
    return table, hits


def rate(golds, hits):
    """Share of rows (with a gold id) whose gold id is among the hits."""
    pairs = [(g[0], {h["id"] for h in hs}) for g, hs in zip(golds, hits) if g]
    return sum(g in ids for g, ids in pairs) / len(pairs)


def recall(rows, hits):
    """Mean recall of the supporting documents over rows that have some."""
    from common.metrics import doc_recall

    pairs = [(r["metadata"]["supporting_doc_ids"], [h["id"] for h in hs]) for r, hs in zip(rows, hits)]
    return sum(doc_recall(ids, gold) for gold, ids in pairs if gold) / sum(1 for gold, _ in pairs if gold)


def format_baselines(table, hits):
    """The baseline table as markdown."""
    cols = ["all", "answerable", "one_hop", "two_hop", "three_hop", "comparison", "yes_no", "popular", "not_popular"]
    lines = ["| setting | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, groups in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{groups.get(c, float('nan')):.3f}" for c in cols) + " |")
    lines += ["", "| retrieval | rate |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in hits.items()]
    return "\n".join(lines)


def world_stats(world_dir):
    """Counts of a world folder: entities by type and flag, questions by split and type, corpus size, bytes."""
    from common.data import read_jsonl

    world_dir = Path(world_dir)
    ents = load_world(str(world_dir))["entities"]
    stats = {
        "entities": dict(Counter(e["type"] for e in ents.values() if not e["decoy_of"])),
        "popular": sum(e["popular"] for e in ents.values()),
        "hidden": sum(e["hidden"] for e in ents.values()),
        "decoys": sum(bool(e["decoy_of"]) for e in ents.values()),
        "corpus": len(read_jsonl(world_dir / "corpus.jsonl")),
        "bytes": sum(p.stat().st_size for p in world_dir.iterdir() if p.is_file()),
    }
    for split in ("train", "dev", "test"):
        rows = read_jsonl(world_dir / f"{split}.jsonl")
        stats[split] = dict(
            Counter(r["metadata"]["type"] for r in rows),
            total=len(rows),
            unanswerable=sum(not r["metadata"]["answerable"] for r in rows),
            popular=sum(r["metadata"]["popular"] for r in rows),
        )
    return stats


class ReasoningReader:
    """The toy reader as a reasoning LLM, for SPARKLE's Fig. 7 mode: its steps are paragraphs without tags and its
    answer is in \\boxed{}; the paragraphs of the thoughts so far are read back as its <think> steps. A `stop` with a
    blank line (or none) asks for one step, any other for every step at once."""

    def __init__(self, reader):
        self.reader = reader

    def chat(self, messages_lists, stop=None, **sampling):
        tag = lambda text: "".join(f"<think> {p.strip()} </think>\n" for p in text.split("\n\n") if p.strip())
        tagged = [[dict(m, content=m["content"] + "\n<think> </think>" if m["role"] == "user" else tag(m["content"]))
                   for m in messages] for messages in messages_lists]  # fmt: skip
        replies = self.reader.chat(tagged, stop=["</think>"] if stop is None or "\n\n" in list(stop) else [])
        boxed = lambda r: re.sub(r"<answer>(.*?)</answer>", r"\\boxed{\1}", re.sub(r"</?think>", "\n\n", r))
        return [re.sub(r"\s*\n\s*", "\n\n", boxed(r).strip()) for r in replies]
