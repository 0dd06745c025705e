"""A small FlashRAG folder of real-format multi-hop rows, and a local chat endpoint that plays the frozen LLMs.

`write_folder(path)` writes invented but coherent facts (16 films, their directors, where and when each was born) as
FlashRAG holds HotpotQA, 2WikiMultihopQA and MuSiQue rows (the metadata layouts common/evidence.py reads), a corpus
cut as wiki-18 cuts an article (100-word passages) with distractor articles, the splits mixed with `common.data`
and given their evidence by `common.evidence`. `triples(corpus)`: the invented facts as the triplets a knowledge graph
holds (one source passage a triplet), what the endpoint's extraction rules answer.
`chat_stub()` serves an OpenAI-compatible /v1/chat/completions on 127.0.0.1 whose replies are a function of the
prompt: each rule, keyed by a phrase of a method's paper prompt, answers in the format that method's parser reads.
"""

import contextlib
import io
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import data, evidence

# (film, year, genre, director); (director, born: day, year, nationality, town, coast): all invented
FILMS = [
    ("The Glass Harbour", 2004, "drama", "Orla Brennick"),
    ("Winter of Calloway", 1998, "thriller", "Tomas Vareldi"),
    ("Saltmarsh Lanterns", 2011, "drama", "Ines Hallowell"),
    ("The Copper Orchard", 2001, "comedy", "Piotr Sandemark"),
    ("Nightfall at Brennan Quay", 1994, "crime", "Maren Kostelic"),
    ("A Map of Quiet Rivers", 2015, "drama", "Callum Ortrey"),
    ("The Lighthouse Ledger", 2008, "mystery", "Yvette Drummore"),
    ("Ember Valley", 1996, "western", "Anselm Quoyle"),
    ("The Orchard Keeper's Daughter", 2013, "drama", "Leona Farthing"),
    ("Paper Kites over Marlow", 2003, "comedy", "Dario Penhallow"),
    ("The Tin Cartographer", 2009, "fantasy", "Signe Althorp"),
    ("Velvet Semaphore", 1999, "thriller", "Rafael Munteza"),
    ("The Weaver of Dunmoor", 2006, "drama", "Hester Callowyn"),
    ("Seven Bells for Idris", 2012, "musical", "Bruno Ketteridge"),
    ("Low Tide at Penrose", 1992, "drama", "Ilse Wardrop"),
    ("The Quiet Semester", 2017, "comedy", "Nadim Arkwright"),
    ("Harbour of Small Hours", 2007, "drama", "Edda Lynmouth"),  # distractors from here: asked about by no row
    ("The Salt Road", 2000, "western", "Gideon Faraway"),
]
PEOPLE = {
    "Orla Brennick": (14, 1961, "Irish", "Cardowan", "western"),
    "Tomas Vareldi": (3, 1952, "Hungarian", "Velmora", "southern"),
    "Ines Hallowell": (27, 1970, "English", "Port Ashby", "eastern"),
    "Piotr Sandemark": (9, 1958, "Danish", "Kestrel Bay", "northern"),
    "Maren Kostelic": (21, 1949, "Croatian", "Lindqvist Falls", "western"),
    "Callum Ortrey": (5, 1974, "Scottish", "Harrowgate Mills", "eastern"),
    "Yvette Drummore": (30, 1966, "French", "Solbridge", "southern"),
    "Anselm Quoyle": (12, 1945, "Canadian", "Tavernier", "northern"),
    "Leona Farthing": (8, 1972, "Australian", "Oakhollow", "eastern"),
    "Dario Penhallow": (17, 1963, "Italian", "Marrisford", "western"),
    "Signe Althorp": (2, 1968, "Norwegian", "Eldwick", "northern"),
    "Rafael Munteza": (25, 1956, "Spanish", "Santa Brisa", "southern"),
    "Hester Callowyn": (11, 1960, "Welsh", "Abermoel", "western"),
    "Bruno Ketteridge": (19, 1967, "Belgian", "Ostvelde", "northern"),
    "Ilse Wardrop": (6, 1947, "Dutch", "Haverlin", "eastern"),
    "Nadim Arkwright": (23, 1975, "English", "Coldmere", "southern"),
    "Edda Lynmouth": (4, 1959, "Icelandic", "Cardowan", "western"),  # born where Orla Brennick was
    "Gideon Faraway": (15, 1951, "American", "Velmora", "southern"),
}
MONTHS = "January March May July September November".split()


def film_sentences(film, year, genre, director):
    """The sentences of a film's article; the first names its director (the supporting fact of hop 1)."""
    return [
        f"{film} is a {year} {genre} film directed by {director}.",
        f"Principal photography took place on the coast during the spring of {year - 1}.",
        "The film follows a young teacher who returns to her home town after many years away.",
        f"{film} premiered at a regional film festival and opened in cinemas in the autumn of {year}.",
        "Critics praised its photography, its slow pacing and the restraint of its central performance.",
        "Its budget was modest, and most of the cast were local actors with little screen experience.",
        "The production was delayed for several weeks after a storm damaged part of the main set.",
        "The score was written for a small string ensemble and recorded in a single church over three days.",
        "It received nominations for editing and sound design at the national film awards.",
        "A restored version was released on home video with a commentary by the cinematographer.",
        "In later interviews the director described the story as a study of memory, distance and the sea.",
    ]


def person_sentences(name):
    """The sentences of a director's article: the birth date first, the birthplace in the second passage."""
    day, year, nationality, town, coast = PEOPLE[name]
    return [
        f"{name} (born {day} {MONTHS[day % 6]} {year}) is an {nationality} film director and screenwriter."
        if nationality[0] in "AEIOU"
        else f"{name} (born {day} {MONTHS[day % 6]} {year}) is a {nationality} film director and screenwriter.",
        f"{name} began working in theatre before moving to short films in the late {year // 10 * 10 + 20}s.",
        "The early short films won prizes at several student festivals and were shown on public television.",
        "A first feature followed a few years later and was shown widely in art-house cinemas across Europe.",
        "The work is known for long takes, natural light and casts made up largely of non-professional actors.",
        "Several of the films were made with the same small crew, including a long-time editor and composer.",
        "Alongside the films there has been teaching at a film school and service on several festival juries.",
        f"{name} was born in {town}, a small town on the {coast} coast, and grew up there.",
        "The town appears in several of the films, often in long scenes shot at dawn on the harbour wall.",
        f"{name} still lives near {town} and works from a converted boathouse by the water.",
    ]


ARTICLES = {f: film_sentences(f, y, g, d) for f, y, g, d in FILMS} | {p: person_sentences(p) for p in PEOPLE}
BORN_AT = 7  # the index of the birthplace sentence in a director's article


def questions():
    """Every question as (id, dataset, split, kind, film): 16 films x (place, year), datasets and splits interleaved
    (24 train, 8 test; every dataset in both)."""
    combos = [(film, kind) for film, *_ in FILMS[:16] for kind in ("place", "year")]
    names = ("hotpotqa", "2wikimultihopqa", "musique")
    return [(f"{'dev' if j % 4 == 3 else 'train'}_{j}", names[j % 3], "test" if j % 4 == 3 else "train", kind, film)
            for j, (film, kind) in enumerate(combos)]  # fmt: skip


QUESTION = {  # dataset -> kind -> the question's wording, in the dataset's style
    "hotpotqa": {"place": "Where was the director of {film} born?",
                 "year": "In what year was the director of {film} born?"},
    "2wikimultihopqa": {"place": "What is the place of birth of the director of film {film}?",
                        "year": "What is the year of birth of the director of film {film}?"},
    "musique": {"place": "In which town was the person who directed {film} born?",
                "year": "In which year was the person who directed {film} born?"},
}  # fmt: skip


def hops_of(film, kind):
    """[(sub-query, answer, supporting sentence id in the answer's article)] of a question: director, then birth."""
    director = next(d for f, _, _, d in FILMS if f == film)
    _, year, _, town, _ = PEOPLE[director]
    born = (f"Where was {director} born?", town, BORN_AT) if kind == "place" else (f"When was {director} born?",
                                                                                  str(year), 0)  # fmt: skip
    return [(f"Who directed {film}?", director, 0), born]


def row_of(qid, dataset, kind, film, edited=False):
    """One row as FlashRAG's <dataset>/<split>.jsonl holds it (metadata: the dataset's own supporting facts)."""
    hops = hops_of(film, kind)
    director, answer = hops[0][1], hops[1][1]
    titles = [film, director]
    sentences = {t: list(ARTICLES[t]) for t in titles}
    if edited:  # the dataset's text differs from the corpus's (another Wikipedia dump): this fact cannot match
        sentences[film][0] = sentences[film][0].replace(" film directed by", " film written and directed by")
    distractors = [FILMS[16][0], FILMS[17][3]]  # context paragraphs that support nothing
    question = QUESTION[dataset][kind].format(film=film)
    row = {"id": qid, "question": question, "golden_answers": [answer]}
    if dataset == "musique":
        steps = []
        for k, ((query, sub_answer, sent), title) in enumerate(zip(hops, titles)):
            paragraph = " ".join(ARTICLES[title][max(sent - 1, 0) : sent + 2])  # the fact and its neighbours
            support = {"idx": 3 + 5 * k, "title": title, "paragraph_text": paragraph, "is_supporting": True}
            wording = query if k == 0 else query.replace(director, "#1")  # MuSiQue's reference to hop 1
            steps.append({"id": 100 + k, "question": wording, "answer": sub_answer, "paragraph_support_idx":
                          support["idx"], "support_paragraph": support})  # fmt: skip
        return row | {"metadata": {"answerable": True, "question_decomposition": steps}}
    facts = {"title": titles, "sent_id": [0, hops[1][2]]}
    if dataset == "hotpotqa":  # its context sentences after the first start with a space
        lines = [[s if i == 0 else " " + s for i, s in enumerate(sentences.get(t, ARTICLES[t]))]
                 for t in titles + distractors]  # fmt: skip
        context = {"title": titles + distractors, "sentences": lines}
        return row | {"metadata": {"type": "bridge", "level": "medium", "supporting_facts": facts, "context": context}}
    relation = "place of birth" if kind == "place" else "date of birth"
    context = {"title": titles + distractors, "content": [ARTICLES[t] for t in titles + distractors]}
    evidences = {"fact": [film, director], "relation": ["director", relation], "entity": [director, answer]}
    meta = {"type": "compositional", "supporting_facts": facts, "context": context, "evidences": evidences}
    return row | {"metadata": meta}


def passages():
    """The corpus: each article's words in passages of 100 (wiki-18's cut), ids in corpus order."""
    out = []
    for title, sentences in ARTICLES.items():
        words = " ".join(sentences).split()
        for i in range(0, len(words), 100):
            out.append({"id": str(len(out)), "contents": f'"{title}"\n' + " ".join(words[i : i + 100])})
    return out


def triples(corpus):
    """The invented facts as {doc_id, head, relation, tail}: each triplet linked to the first passage of its head's
    article that names its tail (what SPARKLE's and TeaRAG's extractions find there)."""
    by_title = {}
    for p in corpus:
        by_title.setdefault(p["contents"].split("\n")[0].strip('"'), []).append(p)
    facts = [(f, "directed by", d) for f, _, _, d in FILMS] + [(f, "release year", str(y)) for f, y, _, _ in FILMS]
    facts += [(p, "born in", v[3]) for p, v in PEOPLE.items()] + [
        (p, "birth year", str(v[1])) for p, v in PEOPLE.items()
    ]
    rows = []
    for head, relation, tail in facts:
        doc = next(p for p in by_title[head] if tail in p["contents"])
        rows.append({"doc_id": doc["id"], "head": head, "relation": relation, "tail": tail})
    return rows


def write_folder(path):
    """The folder a method's --data_dir reads: flashrag/<dataset>/{train,dev}.jsonl as downloaded, train.jsonl and
    test.jsonl mixed from them (common.data) and given their evidence (common.evidence), corpus.jsonl (the methods
    extract their knowledge graphs from it: tests/test_real_data.py).
    Returns {split: the match-rate lines the evidence step printed}."""
    path = Path(path)
    by_file = {}
    for qid, dataset, split, kind, film in questions():
        file = path / "flashrag" / dataset / f"{'dev' if split == 'test' else 'train'}.jsonl"
        by_file.setdefault(file, []).append(row_of(qid, dataset, kind, film, edited=qid == "train_0"))
    for file, rows in by_file.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        data.write_jsonl(file, rows)
    corpus = passages()
    data.write_jsonl(path / "corpus.jsonl", corpus)
    rates = {}
    for split, source in (("train", "train"), ("test", "dev")):
        files = sorted(str(f) for f in by_file if f.stem == source)
        with contextlib.redirect_stdout(io.StringIO()):
            data.main(["--out", str(path / f"{split}.jsonl"), *files])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            evidence.main(["--corpus", str(path / "corpus.jsonl"), "--out", str(path / f"{split}.jsonl"),
                           str(path / f"{split}.jsonl")])  # fmt: skip
        rates[split] = [line for line in printed.getvalue().splitlines() if "facts matched" in line]
    return rates


# --------------------------------------------------------------------------- the chat endpoint
QA = {  # question -> (sub-queries and their answers, the answer): what the stub "knows"
    QUESTION[dataset][kind].format(film=film): ([(q, a) for q, a, _ in hops_of(film, kind)], hops_of(film, kind)[1][1])
    for _, dataset, _, kind, film in questions()
}


def question_in(text):
    """The longest known question the prompt holds, or None."""
    found = [q for q in QA if q in text]
    return max(found, key=len) if found else None


def progress(text, question):
    """(hops whose answer the prompt shows outside its question, the answer it shows: the question's if there, else
    the last sub-answer found, else "unknown")."""
    seen, (hops, answer) = text.replace(question, " "), QA[question]
    k = next((i for i, (_, a) in enumerate(hops) if a not in seen), len(hops))
    return k, answer if answer in seen else hops[k - 1][1] if k else "unknown"


def answer(text, q):
    """What the prompt answers (progress)."""
    return progress(text, q)[1]


def solved(text, q):
    """Whether the prompt shows the question's answer."""
    return answer(text, q) == QA[q][1]


def next_query(text, q):
    """The sub-query of the first hop whose answer the prompt does not show (the last one once all are shown)."""
    hops = QA[q][0]
    return hops[min(progress(text, q)[0], len(hops) - 1)][0]


def section(text, start, end=None):
    """The text between the last `start` and the `end` after it (or the end of the text)."""
    tail = text.rsplit(start, 1)[-1]
    return tail.split(end, 1)[0] if end else tail


def judge(text, _):
    """C-3PO's App. D.2 judge: True when a correct answer is inside the predicted one."""
    golds = re.findall(r"'([^']*)'", section(text, "Correct Answer:", "Predicted Answer:"))
    predicted = section(text, "Predicted Answer:").lower()
    return "True" if any(g.lower() in predicted for g in golds) else "False"


def extract(text, _):
    """SPARKLE's triple extraction (§D.3): the invented facts of the passage's title whose tail the passage names."""
    title, body = section(text, "Title:", "\n").strip(), section(text, "Text:")
    facts = [r for r in triples(passages()) if r["head"] == title and r["tail"] in body]
    return ", ".join(f"<{r['head']}; {r['relation']}; {r['tail']}>" for r in facts) or "None"


def triplets(text, _):
    """TeaRAG's triplet extraction (§4.1, tearag.py's instruction): the facts `extract` finds, written as a chat model
    may: a <think> block, numbered, the first repeated in other case and spacing, a line with two parts."""
    facts = re.findall(r"<([^<>]*)>", extract(text, _))
    lines = [f"{i}. <{f}>" for i, f in enumerate(facts, 1)]
    repeat = ["- < " + "  ; ".join(p.upper() for p in facts[0].split("; ")) + " >"] if facts else []
    return "\n".join(["<think>The passage states these facts.</think>", *lines, *repeat, "<Saltmarsh; drama>"])


def probe(text, q):
    """SmartRAG's Table 7 output: `[Answer] y` when the prompt shows the answer, else `[Search] query`."""
    return f"[Answer] {answer(text, q)}" if solved(text, q) else f"[Search] {next_query(text, q)}"


def filter_docs(text, q):
    """C-3PO's Information Filter: `Thought: ... Action: [ids]` keeping the documents that name a sub-answer."""
    docs = re.findall(r"Document (\d+) \(Title: [^)]*\): (.*)", text)
    keep = ", ".join(i for i, body in docs if any(a in body for _, a in QA[q][0]))
    return f"Thought: {f'Documents {keep} hold' if keep else 'No document holds'} a needed fact.\nAction: [{keep}]"


def decide(text, q):
    """C-3PO's Decision Maker: [LLM] when the documents hold the answer, else [Retrieval] of the next hop."""
    if solved(text, q):
        return f"Thought: The documents say {answer(text, q)}, which answers the question.\nAction: [LLM]"
    return f"Thought: The documents do not answer the question yet.\nAction: [Retrieval] {next_query(text, q)}"


def plan(text, q):
    """C-3PO's roadmap [App. D.1]: one step a hop."""
    return "".join(f"Step {i}: {query}\n" for i, (query, _) in enumerate(QA[q][0], 1))


def think(text, q):
    """SPARKLE's frozen LLM [Fig. 6]: the answer once its context shows it, else one <think> step naming the gap."""
    context = section(text, "Context:", "Question:")
    if solved(context, q):
        return f"<answer> {answer(context, q)} </answer>"
    return f"<think> To answer this I need to know: {next_query(context, q)} </think>"


def retrieval_decision(text, q):
    """SPARKLE's Retrieval Decision [Fig. 4]: No once the retrieved context shows the answer."""
    done = solved(section(text, "Retrieved Context:", "Question:"), q)
    return "No (retrieval is not required)" if done else "Yes (retrieval is required)"


def formulate(text, q):
    """SPARKLE's Query Formulation in Tab. 8's format: the chain of the hops answered so far and the gap."""
    k, hops, query = progress(text, q)[0], QA[q][0], next_query(text, q)
    chain = ", ".join([f"<{sub}; answer; {a}>" for sub, a in hops[:k]] + [f"<{query}; answer; [unknown]>"])
    gap = f"To continue answering the question, we need to know: {query}"
    return f"Step 1: Reasoning Chain: {chain}\nStep 2: Knowledge Gaps: {gap}\nStep 3: Retrieval Query: **{query}**"


def pick_triple(text, q):
    """SPARKLE's Knowledge Integration: the candidate triple naming the next sub-answer, else the first."""
    k, hops = progress(section(text, "Reasoning Chain:"), q)[0], QA[q][0]
    candidates = re.findall(r"<[^<>]*;[^<>]*>", section(text, "Candidate Triples:", "Question:"))
    target = hops[min(k, len(hops) - 1)][1]
    return next((c for c in candidates if target in c), candidates[0] if candidates else "None")


def note(text, q):
    """SPARC-RAG's Context Manager: the old note and the new sentences that name the question's film or a
    sub-answer."""
    old, new = section(text, "Old note:", "New information:").strip(), section(text, "New information:", "Updated")
    names = [a for _, a in QA[q][0]] + [QA[q][0][0][0].removeprefix("Who directed ").rstrip("?")]
    kept = [s for s in re.split(r"(?<=[.!?])\s+", new) if any(n in s for n in names) and s not in old]
    return " ".join([old, *kept]).strip() + " [END]"


def select(text, q):
    """SPARC-RAG's Answer Selection: the branch answer that is the answer, else the first."""
    answers = re.findall(r"Answer \d+: (.*)", text)
    best = next((a for a in answers if QA[q][1] in a), answers[0] if answers else "unknown")
    return f"The best supported answer is {best}. <answer>{best}</answer> [END]"


def merge(text, _):
    """SPARC-RAG's Context Merging: the notes joined, each once."""
    notes = re.findall(r"Note \d+: (.*)", text)
    return " ".join(dict.fromkeys(notes)) + " [END]"


# (a phrase of a method's paper prompt, the rule that answers it): the first rule whose phrase the conversation holds
RULES = [
    ("precise answer validator", judge),  # c3po [App. D.2]
    ("knowledge graph constructor", extract),  # sparkle (impl prompt) [§D.3]
    ("Extract the knowledge triplets", triplets),  # tearag (its instruction) [§4.1]
    ("professional retrieval model", next_query),  # smartrag's warm-up rewriter [App. A.2]
    ("Bing search engine", probe),  # smartrag's knowledge probe [Tab. 7]
    ("requires further information through retrieval", lambda t, q: f"[Retrieval] {next_query(t, q)}"),  # c3po
    ("analyzing the retrieved documents", filter_docs),  # c3po [App. B.1]
    ("assigned to analyze useful information", lambda t, q: "Thought: The documents are enough.\nAction: [LLM]"),
    ("determining the next appropriate action", decide),  # c3po [App. B.1]
    ("formulating a detailed plan", plan),  # c3po [App. D.1]
    ("You are a knowledgeable assistant", answer),  # c3po's answer with documents
    ("Based on your knowledge, answer", answer),  # c3po's answer without documents
    ("whether external information retrieval is required", retrieval_decision),  # sparkle [App. A.1]
    ("generating a high-quality retrieval query", formulate),  # sparkle [App. A.2]
    ("select the most useful knowledge triple", pick_triple),  # sparkle [App. A.3]
    ("Each thought should be put inside <think>", think),  # sparkle [App. A.4]
    ("Act as the context manager", note),  # sparc-rag [App. D]
    ("Answer the question based on the given notes", lambda t, q: f"{answer(t, q)} [END]"),  # sparc-rag [App. D]
    ("select the best answer", select),  # sparc-rag [App. D]
    ("expert at combining contexts", merge),  # sparc-rag [App. D]
]
NO_QUESTION = (judge, extract, triplets, merge)  # the rules that need no known question in the prompt


class ChatStub:
    """The endpoint's state: its URL, how often each rule answered (`calls`, keyed by the rule's phrase) and the
    model names asked for (`models`). It reads the messages and `stop` (cut before the first stop string, as a
    server does); sampling and max_tokens do not change a reply."""

    def __init__(self):
        self.calls, self.models, lock = Counter(), set(), threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = "\n".join(m["content"] for m in body["messages"])
                phrase, rule = next(((p, r) for p, r in RULES if p in text), ("no rule", None))
                q = question_in(text)
                reply = rule(text, q) if rule and (q or rule in NO_QUESTION) else "I do not know."
                for stop in body.get("stop") or []:  # as a server does: cut before the first stop string
                    reply = reply.split(stop, 1)[0]
                with lock:
                    stub.calls[phrase] += 1
                    stub.models.add(body.get("model"))
                payload = {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
                encoded = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(encoded)))
                self.end_headers()
                self.wfile.write(encoded)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@contextlib.contextmanager
def chat_stub():
    """A ChatStub serving in a thread for the block's duration."""
    stub = ChatStub()
    threading.Thread(target=stub.httpd.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield stub
    finally:
        stub.httpd.shutdown()
        stub.httpd.server_close()
