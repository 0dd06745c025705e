# TeaRAG: A Token-Efficient Agentic Retrieval-Augmented Generation Framework
# arXiv:2511.05385v1, 2025 (equation and section tags cite this version). Docs: docs/tearag.md
"""TeaRAG: an agent that reasons in short steps over hybrid (chunk + triplet) retrieval, trained by SFT then IP-DPO.

Each step names its important entities, writes a subquery and emits `<Reference>`; the environment retrieves chunks
(dense + reranker) and knowledge-graph triplets (entities first, then their one-hop triplets), links them in a
Knowledge Association Graph and keeps the top k_f nodes by Personalized PageRank; the agent summarises them, then
takes another step or writes `Final answer:`. SFT teaches the format on paths built from question decompositions.
Iterative Process-aware DPO samples R paths per question, scores them (outcome F1, format, and a process reward against
the golden evidence divided by the step count), pairs them and trains DPO + eta SFT on the previous round's model.

    accelerate launch tearag.py --train                      # toy world, tiny model, CPU: SFT, 3 IP-DPO rounds, eval
    python tearag.py --eval --model runs/<run_name>/dpo      # evaluate a checkpoint (--retrieval semantic: Table 7)
    python tearag.py --ask "who is the director of sutisek ?" --model runs/<run_name>/dpo
    accelerate launch tearag.py --train --preset paper --data_dir data/tearag --index indexes/e5_wiki18

The paper prints no prompt: the instruction and the summary templates are ours (`# proposal:`).

Departures from the paper, in both presets (each marked `# simplification:` where it lives):
1. The knowledge graph: our triplet-extraction instruction (the paper prints none), the graph held in memory.
2. SFT subqueries are the decomposition's as written, not rewritten into fluent questions by Qwen2.5-72B.
3. SFT supporting triplets: the step passage's triplets whose head or tail is its answer (paper: Qwen2.5-72B picks).
4. SFT important entities: the supporting triplets' entities that the subquery names (paper: all their entities).
5. `</Reference>` is written by the environment and masked like the evidence between the tags.
6. The SFT losses are token means (SFT: over a batch's loss tokens, IP-DPO: its chosen paths'), not Eq. 4/15's sums.
7. One LoRA adapter is trained through SFT and all rounds (Theta_p starts from Theta_{p-1}, nothing merged).
8. Golden evidence: a multi-hop question's supporting passages, HotpotQA's too (paper: its evidence sentences).

Toy-world adaptations (the toy preset's values, PRESETS; the toy machinery lives in common/toy/tearag.py):
9. Toy retrieval system: a TF-IDF bi-encoder and a lexical cross-scorer stand in for E5-base-v2 and BGE-reranker-v2.
10. Toy preset: full fine-tuning of a 0.6M model; SFT by steps on all types (sft_single_steps off), sft_distractors.
11. Toy preset: the compact templates, the question without the instruction (the paper's: the system turn).
12. Toy world only: SFT paths are entity-renamed (augment_p) so that the tiny model reads instead of memorising.
13. Toy preset: the SFT starts on comparison and yes/no paths alone (sft_curriculum) before the whole mix.
"""

import json
import math
import random
import re
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.utils import gather_object

from common import retrieval, runs
from common.data import UserError, load_split, read_jsonl, sample_rows, write_jsonl
from common.llm import add_lora, chat_prompts, generate, right_pad, unknown_words
from common.metrics import answer_scores, f1_score, summarize
from common.models import load_model_and_tokenizer, make_llm
from common.retrieval import CrossEncoderReranker, DenseRetriever, load_retriever, make_encoder, open_retriever
from common.runs import arg
from common.toy import load_world
from common.toy import tearag as toy


@dataclass
class Args:
    preset: str = arg("toy", "toy (toy world, tiny model, CPU) or paper", choices=["toy", "paper"], group="run")
    train: bool = arg(False, "SFT, then the IP-DPO rounds, then evaluation")
    eval: bool = arg(False, "evaluate --model (a checkpoint or the untrained start)")
    ask: str = arg("", "answer one question with --model and print the reasoning path")
    output_dir: str | None = arg(None, "run folder (default: runs/<run_name>; --eval: <model>/eval/<data>-<time>)")
    run_name: str | None = arg(None, "a training run's name (default tearag__<seed>__<time>)")
    resume: bool = arg(False, "continue the run --run_name / --output_dir")
    dry_run: bool = arg(False, "print the resolved configuration, check its paths and models, load nothing")
    report_to: str = arg("none", "tracker beside metrics.jsonl", choices=["none", "tensorboard", "wandb"])
    seed: int = arg(0, "seed of models, sampling and data order")
    world: str | None = arg(None, runs.WORLD_HELP)
    data_dir: str | None = arg(None, "folder of the QA splits (FlashRAG jsonl)", group="data, retrieval system, model")
    corpus: str | None = arg(None, "chunk corpus jsonl (default: data_dir/corpus.jsonl)")
    triples: str | None = arg(None, "graph: jsonl of {doc_id, head, relation, tail} (default: data_dir/triples.jsonl)")
    extract_triples: str = arg("", "write --triples of --corpus by this LLM: hf:<model>, a URL serving --model [§4.1]")
    index: str = arg("", "saved chunk retriever folder (python -m common.retrieval build)")
    entity_index: str = arg("", "saved retriever over the entity names (default: built in memory)")
    encoder: str | None = arg(None, "dense bi-encoder when no index is given [§5.1.3: E5-base-v2]")
    reranker: str | None = arg(None, "cross-encoder (hub id / folder) or lexical [§5.1.3: BGE-reranker-v2]")
    model: str | None = arg(None, "policy LLM: hub id, local folder or toy-lm spec")
    lora_r: int | None = arg(None, "LoRA rank, 0: full fine-tuning [§5.1.3: 8, alpha 32, dropout 0.1]")
    templates: str | None = arg(None, "paper (the instruction as system turn) or compact", flag=False)
    sft_split: str = arg("train", "SFT questions with a decomposition: data_dir/<split>.jsonl [§4.3.1]")
    sft_types: str = arg("", "metadata types of the SFT questions (both presets: all)", flag=False)
    dpo_split: str = arg("train", "IP-DPO sampling questions: data_dir/<split>.jsonl [Tab. 2]")
    dpo_types: str = arg("", "metadata types of the IP-DPO questions (both presets: all)", flag=False)
    n_dpo: int | None = arg(None, "IP-DPO questions, the same each round (None: all) [Tab. 2: 10,000]", low=1)
    n_eval: int | None = arg(None, "test questions evaluated (None: all)", low=1)
    retrieval: str = arg("ppr", "ppr (TeaRAG) or a Table 7 variant", choices=["ppr", "semantic", "graph", "concat"],
                         group="retrieval [§4.2.3-4.2.5, §5.1.3]")  # fmt: skip
    chunk_candidates: int = arg(20, "dense chunk candidates before reranking [§5.1.3: 20]", low=1, flag=False)
    k_d: int = arg(5, "chunks kept after reranking [§5.1.3: 5]", low=1)
    entity_candidates: int = arg(10, "entities per entity query [§5.1.3: 10]", low=1, flag=False)
    k_entities: int = arg(5, "entities kept after reranking [§5.1.3: 5]", low=1)
    triplet_candidates: int = arg(20, "dense triplet candidates before reranking [§5.1.3: 20]", low=1, flag=False)
    k_t: int = arg(10, "triplets kept after reranking [§5.1.3: 10]", low=1)
    k_f: int = arg(5, "context items per retrieval [§5.1.3: 5]", low=1)
    tau: float = arg(0.2, "triplet relevance threshold [Eq. 2; §5.1.3: 0.2]", low=0.0, high=1.0)
    alpha: float = arg(0.5, "PPR weight of the graph term [Eq. 3; §5.1.3: 0.5]", low=0.0, high=1.0)
    ppr_iterations: int = arg(200, "PPR iterations N [§5.1.3: 200]", low=1, flag=False)
    max_steps: int = arg(5, "reasoning steps per path [§5.1.3: k <= 5]", low=1, flag=False)
    max_new_tokens: int | None = arg(None, "tokens per generate call (summary + step header, or the answer)", low=1)
    sft_steps: int | None = arg(None, "SFT steps (0: one epoch [§5.1.3])", low=0, group="SFT [§4.3.1, §5.1.3]")
    sft_lr: float | None = arg(None, "SFT learning rate [§5.1.3: 5e-4]")
    sft_batch_size: int | None = arg(None, "SFT batch size [§5.1.3: 128]", low=1)
    sft_single_steps: bool | None = arg(None, "each SFT step also as a 1-hop question [§4.3.1, Tab. 1]", flag=False)
    sft_distractors: int | None = arg(None, "retrieved items added to each SFT context (ours)", low=0, flag=False)
    weight_decay: float = arg(0.001, "AdamW weight decay of SFT and DPO [§5.1.3: 0.001]", low=0.0, flag=False)
    micro_batch_size: int | None = arg(None, "SFT paths or DPO pairs per forward pass", low=1)
    augment_p: float | None = arg(None, "toy world: entity-renaming probability of an SFT path", low=0.0, flag=False)
    sft_curriculum: str | None = arg(None, "toy: 'types:share:lr', share x sft_steps on those types first", flag=False)
    rounds: int = arg(3, "IP-DPO rounds [§5.5.1: TeaRAG-1..3]", low=0, group="IP-DPO [§4.3.2, §5.1.3]")
    n_rollouts: int = arg(8, "sampled paths per question R [§5.1.3: 8]", low=1)
    temperature: float = arg(1.0, "sampling temperature of the rollouts (ours: 1.0)", flag=False)
    dpo_epochs: str | None = arg(None, "epochs of each round, the first --rounds of them [§5.1.3: 2,2,1]")
    eta: str = arg("1,0.5,0.25", "SFT weight of each round, the first --rounds [Eq. 17; §5.1.3: within 0.25-1]")
    beta: float = arg(0.5, "DPO beta [Eq. 16; §5.1.3: 0.5]")
    dpo_lr: float | None = arg(None, "IP-DPO learning rate [§5.1.3: 1e-4]")
    dpo_batch_size: int = arg(16, "pairs per IP-DPO step [§5.1.3: 16]", low=1)
    rollout_batch: int | None = arg(None, "questions per batched rollout (times R paths)", low=1)


PRESETS = {  # field: (toy, paper), for the fields left at None; any flag overrides them
    "data_dir": ("data/toy", "data/tearag"),
    "encoder": ("tfidf", "intfloat/e5-base-v2"),  # simplification: the toy's TF-IDF (header item 9)
    "reranker": ("lexical", "BAAI/bge-reranker-v2-m3"),  # toy: common/toy/tearag.py's cross-scorer
    "model": ("toy-lm", "meta-llama/Meta-Llama-3-8B-Instruct"),  # simplification: a tiny model (header item 10)
    "lora_r": (0, 8),  # the toy model: full fine-tuning
    "templates": ("compact", "paper"),  # simplification: the question without the instruction (header item 11)
    "n_dpo": (96, None),  # a toy round: 96 questions
    "n_eval": (200, None),
    "max_new_tokens": (40, 512),  # a toy step is a few words
    "sft_steps": (900, 0),  # the toy SFT: 900 steps, not one epoch
    "sft_lr": (2e-3, 5e-4),
    "sft_batch_size": (16, 128),
    "sft_single_steps": (False, True),  # toy: the paper's SFT mix left IP-DPO few pairs (docs/log.md)
    "sft_distractors": (3, 0),  # ours: 3 retrieved items beside the golden ones (header item 10)
    "micro_batch_size": (64, 2),  # memory only: every loss is the same for any micro-batch
    "augment_p": (1.0, 0.0),  # toy world only: every SFT path renamed (header item 12)
    "sft_curriculum": ("comparison,yes_no:2/3:1e-3", ""),  # toy: 600 steps on comparisons first (header item 13)
    "dpo_epochs": ("1,1,1", "2,2,1"),  # toy: one epoch a round
    "dpo_lr": (2e-4, 1e-4),
    "rollout_batch": (96, 64),  # throughput only
}


def apply_preset(args):
    """The preset's column for the fields left at None, derived paths, per-round lists cut; all problems, one line."""
    for key, values in PRESETS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[args.preset == "paper"])
    args.corpus = args.corpus or str(Path(args.data_dir) / "corpus.jsonl")
    args.triples = args.triples or str(Path(args.data_dir) / "triples.jsonl")
    args.world = args.world or runs.toy_world(None, args.data_dir)  # the preset's data folder may hold the world
    positive = ("sft_lr", "dpo_lr", "beta")
    problems = [f"--{k} {getattr(args, k)}: must be > 0" for k in positive if getattr(args, k) <= 0]
    for name, accepts, ok in (("dpo_epochs", "whole numbers >= 1", lambda v: v >= 1 and v == int(v)),
                              ("eta", "numbers >= 0", lambda v: v >= 0)):  # fmt: skip
        try:
            values = runs.per_round(getattr(args, name), args.rounds, f"--{name}")  # a longer list: its first values
        except SystemExit as e:
            problems.append(str(e))
            continue
        except ValueError:  # not a number
            values = [-1.0]
        if not all(map(ok, values)):
            problems.append(f"--{name} {getattr(args, name)!r}: comma-separated {accepts}, one per round")
        setattr(args, name, ",".join(f"{v:g}" for v in values))
    if problems:
        raise UserError("; ".join(problems))
    if args.output_dir is None and args.eval:  # --eval's own folder, never over an earlier evaluation
        args.output_dir = runs.eval_dir(args, "tearag")
    return args


# --------------------------------------------------------------------------- 1. prompts and formats [§4.2, Fig. 4]
REF_OPEN, REF_CLOSE = "<Reference>", "</Reference>"  # [§4.2.5, Fig. 4a] the tokens that wrap the retrieved context
ENTITY_QUERY = "Key entity: {entity}. Query: {subquery}."  # [§4.2.3] verbatim
# proposal: the paper prints no instruction; this one is ours, the same in SFT, sampling and evaluation
INSTRUCTION = """\
You are a question-answering agent that solves the question step by step with a search tool.
In each step, write exactly:
Step {i}:
Important entity: <the key entity or entities this step is about, separated by "; ">
Subquery: <one simple question about these entities; it must contain each important entity verbatim>
<Reference>
Retrieved evidence (chunks and triplets) will be inserted here by the system; then write:
Summary: <the key facts from the evidence, then "... logically implies the answer: <answer to the subquery>.">
When the collected information is sufficient, instead of a new step write:
Final answer: <short answer>
Use at most 5 steps. Do not write anything after the final answer."""
QUESTION = "Question: {question}"
# proposal: "diverse templates" in two parts, the supporting triplets then the answer [§4.3.1 (5)]
SUMMARIES = (
    "The fact {facts} logically implies the answer: {answer}.",  # the case study's pattern [Tab. 11]
    "According to the evidence, {facts}. Therefore, the answer is: {answer}.",
    "Based on {facts}, we can conclude the answer: {answer}.",
)
FORMAT_WORDS = "Step Important entity Subquery Summary Final answer Evidence Title Text Triplet " + " ".join(SUMMARIES)


def encode_prompts(tokenizer, questions, templates):
    """Token ids of the questions' chats: the instruction I as system turn (paper), or the question alone (compact)."""
    system = [{"role": "system", "content": INSTRUCTION}] if templates == "paper" else []
    chats = [system + [{"role": "user", "content": QUESTION.format(question=q)}] for q in questions]
    return tokenizer(chat_prompts(tokenizer, chats), add_special_tokens=False)["input_ids"]


def step_header(i, entities, subquery):
    """What the model writes to open step i, ending with the retrieval trigger [§4.2.1-4.2.2, Tab. 11]."""
    return f"Step {i}:\nImportant entity: {'; '.join(entities)}\nSubquery: {subquery}\n{REF_OPEN}"


def item_text(item):
    """A context item (or a corpus passage) as text: a triplet's head, relation and tail, or a title and text."""
    if item.get("kind") == "triplet":
        return f"{item['head']} {item['relation']} {item['tail']}"
    return f"{item['title']} {item['text']}".strip()


def reference_block(items):
    """What the environment writes after <Reference>: one evidence line per item, then </Reference> [Tab. 11]."""
    lines = []
    for n, it in enumerate(items, 1):
        body = f'Title: "{it["title"]}" Text: {it["text"]}' if it["kind"] == "chunk" else f"Triplet: {item_text(it)}"
        lines.append(f"Evidence {n}: {body}")
    return "\n" + "\n".join(lines) + f"\n{REF_CLOSE}\n"


# --------------------------------------------------------------------------- 2. parsing and the format check
HEADER = re.compile(r"step\s*(\d+)\s*:\s*important\s+entity\s*:(.*?)subquery\s*:(.*)", re.IGNORECASE | re.DOTALL)
STEP_START = re.compile(r"step\s*\d+\s*:", re.IGNORECASE)
SUMMARY = re.compile(r"\s*summary\s*:(.*?)(step\s*\d+\s*:.*|final\s+answer\s*:(.*))?", re.IGNORECASE | re.DOTALL)
FINAL = re.compile(r"final\s+answer\s*:", re.IGNORECASE)


class StepHeader(NamedTuple):
    """What the model writes to open a step [§4.2.1-4.2.2]: its number, important entities and subquery."""

    number: int
    entities: list
    subquery: str


def parse_header(text):
    """The StepHeader of the last step header in text (before its <Reference>), or None."""
    starts = [m.start() for m in STEP_START.finditer(text)]
    m = HEADER.fullmatch(text.replace(REF_OPEN, ""), starts[-1]) if starts else None
    return StepHeader(int(m[1]), [v.strip() for v in m[2].split(";") if v.strip()], m[3].strip()) if m else None


def step_is_valid(i, header, summary, last):
    """The format of step i [Eq. 6]: "Step i:" with entities and a subquery, a summary, the next step or the answer."""
    if header is None or summary is None or header.number != i:
        return False
    if not (header.entities and header.subquery and summary[1].strip()):
        return False
    answer = summary[3]
    return (answer is not None and answer.strip() != "") if last else answer is None


def parse_path(text):
    """Steps (entities, subquery, summary), final answer and format check of a path's text [§4.2, Eq. 6; ours]: valid
    with k >= 1 valid steps (step_is_valid), then one non-empty "Final answer:" and nothing after it."""
    pieces = re.split(f"{REF_OPEN}.*?{REF_CLOSE}", text, flags=re.DOTALL)  # [head 1, summary 1 + head 2, ..., answer]
    answers = FINAL.split(text)
    steps, valid, header = [], [], parse_header(pieces[0])
    for i, piece in enumerate(pieces[1:], 1):
        summary, last = SUMMARY.fullmatch(piece), i == len(pieces) - 1
        valid.append(step_is_valid(i, header, summary, last))
        entities, subquery = (header.entities, header.subquery) if header else ([], "")
        steps.append({"entities": entities, "subquery": subquery, "summary": summary[1].strip() if summary else ""})
        header = parse_header(summary[2]) if summary and summary[2] and not last else None
    opened = len(pieces) > 1 and STEP_START.match(pieces[0].strip()) is not None
    stray = any(tag in piece for piece in pieces for tag in (REF_OPEN, REF_CLOSE))  # a tag outside a block
    ends = len(answers) == 2 and not STEP_START.search(answers[1])  # one final answer, no step after it
    format_ok = opened and all(valid) and not stray and ends
    return {"steps": steps, "answer": answers[-1].strip() if len(answers) > 1 else "", "format_ok": format_ok}


# --------------------------------------------------------------------------- 3. the retrieval system R [§4.2.3-4.2.5]
def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def norm_name(name):
    """Entity identity across key entities, titles and triplets: lowercased, spaces collapsed, quotes stripped."""
    return " ".join(str(name).lower().split()).strip("\"'")


class KnowledgeGraph:
    """Triplets with their source chunk, and the one-hop triplets of each entity (as head or tail) [§4.1]."""

    def __init__(self, path):
        # simplification: the graph is read from a file and held in memory (header item 1)
        keys, rows = ("head", "relation", "tail", "doc_id"), read_jsonl(path, ("doc_id", "head", "relation", "tail"))
        self.triplets = [{"kind": "triplet", "id": i, **{k: str(r[k]) for k in keys}} for i, r in enumerate(rows)]
        self.by_entity, self.by_doc = defaultdict(list), defaultdict(list)
        for t in self.triplets:
            self.by_entity[norm_name(t["head"])].append(t["id"])
            self.by_entity[norm_name(t["tail"])].append(t["id"])
            self.by_doc[t["doc_id"]].append(t)
        self.entities = sorted({name for t in self.triplets for name in (t["head"], t["tail"])})


# simplification: the paper prints no extraction instruction ([84]'s, with Qwen2.5-14B-Instruct); ours (header item 1)
EXTRACTION = """\
Extract the knowledge triplets that the passage states, one per line, as <head entity; relation; tail entity>.
Name each entity as the passage does and keep each relation short. Write nothing else.
Title: {title}
Text: {text}"""


def parse_triplets(reply):
    """The distinct (head, relation, tail) of an extraction reply [§4.1]: after a <think> block, one a line (numbering,
    bullets, <> optional; not three non-empty parts: dropped), spaces collapsed, a case/space repeat kept once."""
    found = {}
    answer = reply.rpartition("</think>")[2] if "</think>" in reply else reply.split("<think>")[0]
    for line in answer.splitlines():
        for span in re.findall(r"<([^<>]*)>", line) or [re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line)]:
            parts = [" ".join(part.split()).strip("*` ") for part in span.split(";")]
            if len(parts) == 3 and all(parts) and parts != ["head entity", "relation", "tail entity"]:
                found.setdefault(tuple(map(norm_name, parts)), tuple(parts))
    return list(found.values())


def extracted(out):
    """{chunk id: its triplets} in the parts of an extraction into `out` (a line that a kill tore: skipped)."""
    done = {}
    for line in [line for part in out.parent.glob(f"{out.name}.part*") for line in part.open(encoding="utf-8")]:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        done[row["doc_id"]] = row["triplets"]
    return done


def extract_triples(flags, batch_size=64):
    """G = (V, E) [§4.1]: each --corpus chunk's triplets by the frozen LLM --extract_triples, with its chunk id, into
    --triples; the chunks left are split over the processes, each appends its batches to <triples>.part<rank>."""
    served, args = flags.model, apply_preset(flags)  # --model: the endpoint's served model name
    spec, out = args.extract_triples, Path(args.triples)
    endpoint = spec.startswith(("http://", "https://"))
    if not (spec.startswith("hf:") or endpoint) or (endpoint and not served):
        raise UserError(f"--extract_triples {spec}: hf:<model>, or a URL with --model (toy: data/toy ships its graph)")
    state, docs = PartialState(cpu=not torch.cuda.is_available()), retrieval.load_corpus(args.corpus)
    done = extracted(out)
    state.wait_for_everyone()  # every process has read the parts before any appends to them
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = [d for d in docs if str(d["id"]) not in done][state.process_index :: state.num_processes]
    llm = make_llm(spec, **({"model": served} if endpoint else {}))
    with out.with_name(f"{out.name}.part{state.process_index}").open("a", encoding="utf-8", buffering=1) as f:
        for s in runs.progress(range(0, len(todo), batch_size), f"triplets (process {state.process_index})"):
            chats = [[{"role": "user", "content": EXTRACTION.format(**d)}] for d in todo[s : s + batch_size]]
            # ours: greedy, up to 512 tokens a reply
            for d, reply in zip(todo[s : s + batch_size], llm.chat(chats, temperature=0.0, max_tokens=512)):
                # a line of its own, flushed: never written onto a line that a kill tore
                f.write("\n" + json.dumps({"doc_id": str(d["id"]), "triplets": parse_triplets(reply)}))
    state.wait_for_everyone()
    if state.is_main_process:
        done = extracted(out)
        rows = [dict(doc_id=str(d["id"]), head=h, relation=r, tail=t) for d in docs for h, r, t in done[str(d["id"])]]
        write_jsonl(out, rows)  # the edges E, their entities V [§4.1]
        for part in out.parent.glob(f"{out.name}.part*"):
            part.unlink()
        print(f"{len(rows)} triplets of {len(docs)} chunks -> {out}")


class RetrievalSystem:
    """R: dense chunk retrieval and reranking, two-stage graph retrieval, KAG + PPR selection [§4.2.3-4.2.5]."""

    def __init__(self, args, device="cpu"):
        self.args, self.kg = args, KnowledgeGraph(args.triples)
        self.chunks = open_retriever(args.index, args.corpus, args.encoder)
        self.encoder = getattr(self.chunks, "encoder", None)  # ranks E_entity's triplets (none: the reranker alone)
        names = [{"id": e, "contents": e} for e in self.kg.entities]  # the graph's entities, for the entity queries
        build = lambda: DenseRetriever.build(names, make_encoder(args.encoder))
        self.entities = load_retriever(args.entity_index) if args.entity_index else build()
        self.docs = {str(d["id"]): d for d in self.chunks.corpus}
        lexical = lambda: toy.LexicalReranker([d["contents"] for d in self.chunks.corpus])
        # simplification: the toy's cross-scorer for BGE-reranker-v2 (header item 9)
        self.rerank = lexical() if args.reranker == "lexical" else CrossEncoderReranker(args.reranker, device)

    def sim(self, golds, texts):
        """sim_theta(g, x) = sigmoid(reranker logit of (g, x)), (len(golds), len(texts)) [Eq. 9-11]."""
        return sigmoid(self.rerank([(g, x) for g in golds for x in texts])).reshape(len(golds), len(texts))

    def chunk(self, doc_id):
        d = self.docs[str(doc_id)]
        return {"kind": "chunk", "id": str(d["id"]), "doc_id": str(d["id"]), "title": d["title"], "text": d["text"]}

    def top(self, query, items, k):
        """The k items with the highest reranker logits against query, best first, the logit kept as "score"."""
        scores = self.rerank([(query, item_text(it)) for it in items]) if items else []
        return [{**it, "score": float(s)} for it, s in sorted(zip(items, scores), key=lambda x: -x[1])[:k]]

    def retrieve(self, subqueries, entity_lists):
        """The context C_q of each (subquery, key entities) [§4.2.3-4.2.5]: k_f items (ppr) or a Table 7 variant."""
        a = self.args
        if not subqueries:
            return []
        chunk_hits = self.chunks.search(subqueries, a.chunk_candidates)  # D_q = R(q_i, D), top-20 then rerank
        entity_queries = [
            [ENTITY_QUERY.format(entity=v, subquery=q) for v in ents] or [q]  # no entity: q (ours)
            for q, ents in zip(subqueries, entity_lists)
        ]
        entity_hits = iter(self.entities.search([x for qs in entity_queries for x in qs], a.entity_candidates))
        contexts = []
        for q, ents, queries, hits in zip(subqueries, entity_lists, entity_queries, chunk_hits):
            chunks = self.top(q, [self.chunk(h["id"]) for h in hits], a.k_d)
            found = {}  # candidate entity -> best logit over the entity queries that returned it (ours)
            for x in queries:
                names = [h["contents"] for h in next(entity_hits)]
                for name, s in zip(names, self.rerank([(x, n) for n in names])):
                    found[name] = max(found.get(name, -np.inf), s)
            kept = sorted(found, key=lambda n: -found[n])[: a.k_entities]  # V_q
            pool = sorted({i for n in kept for i in self.kg.by_entity[norm_name(n)]})  # E_entity: one-hop triplets
            contexts.append(self.select(ents, chunks, self.top_triplets(q, [self.kg.triplets[i] for i in pool])))
        return contexts

    def top_triplets(self, q, triplets):
        """E_q = R(q, E_entity): dense top-20 by inner product, reranked to k_t [§4.2.3, §5.1.3]."""
        if self.encoder is not None and len(triplets) > self.args.triplet_candidates:
            qv = self.encoder.encode([q], is_query=True)[0]  # (dim,)
            scores = self.encoder.encode([item_text(t) for t in triplets]) @ qv  # (n,)
            triplets = [triplets[i] for i in np.argsort(-scores, kind="stable")[: self.args.triplet_candidates]]
        return self.top(q, triplets, self.args.k_t)

    def select(self, entities, chunks, triplets):
        """C_q: the top-k_f chunk and triplet nodes by PPR on the KAG (ppr), or a Table 7 retrieval variant."""
        a = self.args
        if a.retrieval == "semantic":  # TeaRAG-S [Tab. 7]
            return chunks[: a.k_f]
        if a.retrieval == "graph":  # TeaRAG-G
            return triplets[: a.k_f]
        if a.retrieval == "concat":  # TeaRAG-Con: top-5 chunks and top-5 triplets, 10 units [§5.5.1]
            return chunks[:5] + triplets[:5]
        nodes, adjacency = build_kag(entities, chunks, triplets, a.tau)
        pi = personalized_pagerank(adjacency, personalization(nodes, entities), a.alpha, a.ppr_iterations)
        return top_nodes(nodes, pi, chunks + triplets, a.k_f)


def build_kag(key_entities, chunks, triplets, tau):
    """Nodes and symmetric weighted adjacency (n, n) of the Knowledge Association Graph [§4.2.4]. Node keys: ("Q",)
    the subquery, ("D", id) a chunk, ("T", id) a triplet, ("V", name) an entity; a simple graph (ours)."""
    nodes, edges = {("Q",): 0}, {}
    node = lambda key: nodes.setdefault(key, len(nodes))

    def link(a, b, w):
        if a != b and w > 0:  # no self-loop; weight 0: no edge [Eq. 2]
            edges.setdefault((min(a, b), max(a, b)), w)  # a repeated co-occurrence keeps weight 1

    for v in key_entities:
        node(("V", norm_name(v)))
    for d in chunks:
        c = node(("D", d["id"]))
        link(c, 0, float(sigmoid(d["score"])))  # chunk-subquery relevance edge [Eq. 1]
        if d["title"]:
            link(c, node(("V", norm_name(d["title"]))), 1.0)  # chunk-title co-occurrence edge
    for e in triplets:
        t, h, tl = node(("T", e["id"])), node(("V", norm_name(e["head"]))), node(("V", norm_name(e["tail"])))
        link(t, 0, max(float(sigmoid(e["score"])) - tau, 0.0))  # triplet-subquery relevance edge [Eq. 2]
        for a, b in ((h, tl), (t, h), (t, tl)):  # entity-entity, triplet-entity
            link(a, b, 1.0)
        for c in [nodes[("D", d["id"])] for d in chunks if d["id"] == e["doc_id"]]:  # its source chunk: co-occurrence
            for a, b in ((t, c), (c, h), (c, tl)):  # chunk-triplet, chunk-entity
                link(a, b, 1.0)
    adjacency = np.zeros((len(nodes), len(nodes)))
    for (a, b), w in edges.items():
        adjacency[a, b] = adjacency[b, a] = w
    return list(nodes), adjacency


def personalization(nodes, entities):
    """p of Eq. 3 over the KAG's nodes: 1 on the subquery, 0.5 on the key entities, 0 elsewhere [§4.2.5]."""
    seeds = {("V", norm_name(v)) for v in entities}
    return np.array([1.0 if n == ("Q",) else 0.5 if n in seeds else 0.0 for n in nodes])


def personalized_pagerank(adjacency, p, alpha=0.5, n_iter=200):
    """pi = alpha W pi + (1 - alpha) p, N rounds [Eq. 3]; W column-stochastic, p normalised, pi_0 = p (ours)."""
    degree = adjacency.sum(0)  # (n,)
    W = np.divide(adjacency, degree, out=np.zeros_like(adjacency), where=degree > 0)  # W[j, i] = A[j, i] / deg(i)
    p = p / p.sum()  # (n,)
    pi = p.copy()
    for _ in range(n_iter):
        pi = alpha * W @ pi + (1 - alpha) * p
    return pi


def top_nodes(nodes, pi, items, k):
    """The k chunk/triplet items with the highest PPR score, in that order; ties keep the retrieval order."""
    index = {key: i for i, key in enumerate(nodes)}
    return sorted(items, key=lambda it: -pi[index[("D" if it["kind"] == "chunk" else "T", it["id"])]])[:k]


# --------------------------------------------------------------------------- 4. rewards [Eq. 5-13]
def cover_exact_match(entities, subquery):
    """r_CEM = 1 iff every key entity is a substring of the subquery [Eq. 8] (lowercased; no entity: 0)."""
    q = " ".join(subquery.lower().split())
    return float(bool(entities) and all(" ".join(v.lower().split()) in q for v in entities))


def process_reward(cem, sim_q, sim_c, sim_s):
    """r_process [Eq. 7-13] from the CEM of each of the k steps (k,) and the similarities of the l golden evidence
    pieces to each subquery (l, k), to every context item of the path (l, n) and to each summary (l, k)."""
    k = len(cem)
    r_consistency = sum(cem) / k  # [Eq. 7]
    r_q = np.max(sim_q, 1).sum() / k  # memory vector M^q [Eq. 9], summed, divided by the step count [Eq. 12]
    r_c = np.max(sim_c, 1).sum() / k  # M^c: max over every item of every C_q [Eq. 10, 12]
    r_s = np.max(sim_s, 1).sum() / k  # M^s [Eq. 11, 12]
    return float(0.1 * r_consistency + 0.3 * r_q + 0.3 * r_c + 0.3 * r_s)  # [Eq. 13]


def path_rewards(path, evidence, sim):
    """(r_format, r_outcome, r_process) of a path [Eq. 5, 6, 13]. Without golden evidence (a single-hop question):
    the outcome divided by the step count and no process reward [§4.3.2]."""
    steps, k = path.steps, len(path.steps)
    r_format, r_outcome = float(path.format_ok), f1_score(path.answer, path.row["golden_answers"])  # [Eq. 6], [Eq. 5]
    if not evidence or k == 0:
        return r_format, r_outcome / max(k, 1), 0.0  # single-hop: r_outcome / k, r_process = 0
    items = [item_text(it) for ctx in path.contexts for it in ctx] or [""]
    cem = [cover_exact_match(s["entities"], s["subquery"]) for s in steps]
    sim_q, sim_s = sim(evidence, [s["subquery"] for s in steps]), sim(evidence, [s["summary"] for s in steps])
    return r_format, r_outcome, process_reward(cem, sim_q, sim(evidence, items), sim_s)


def golden_evidence(row, docs):
    """G = [g_1..g_l] [§4.3.2]: a multi-hop question's supporting passages in the corpus ([] for a single-hop one)."""
    meta = row.get("metadata") or {}
    if int(meta.get("hops") or 1) < 2:
        return []
    # simplification: supporting passages, HotpotQA's too (the paper: its evidence sentences) (header item 8)
    return [item_text(docs[i]) for i in map(str, meta.get("supporting_doc_ids") or []) if i in docs]


# --------------------------------------------------------------------------- 5. preference pairs [Eq. 14]
def is_chosen(r, single_hop, eps=1e-9):
    """Membership of the chosen set W [Eq. 14] of r = (r_format, r_outcome, r_process)."""
    fmt, out, proc = r
    if single_hop:
        return fmt == 1 and out >= 1 - eps
    return fmt == 1 and ((out >= 1 - eps and proc >= 0.7 - eps) or (out >= 0.8 - eps and proc >= 0.8 - eps))


def rejection_type(r, c, single_hop, eps=1e-9):
    """ "format", "easy" or "hard" when path r may be rejected against the chosen path c [§4.3.2], else None."""
    if r[0] == 0:
        return "format"
    if r[1] <= 0.3 + eps:
        return "easy"
    if not single_hop and 0.3 < r[1] <= c[1] - 0.3 + eps and r[2] <= c[2] + eps:
        return "hard"  # single-hop questions: format and easy rejections only
    return None


def build_pairs(rewards, single_hop):
    """[(chosen, rejected, type)] of one question's paths [§4.3.2]: each chosen path, best first, matched by a
    forward-only walk over all paths, worst first."""
    chosen = sorted((i for i, r in enumerate(rewards) if is_chosen(r, single_hop)), key=lambda i: -sum(rewards[i]))
    ranked = sorted(range(len(rewards)), key=lambda i: sum(rewards[i]))  # stable: ties by sample index
    pairs, ptr = [], 0
    for c in chosen:
        while ptr < len(ranked):
            r, ptr = ranked[ptr], ptr + 1
            kind = None if r in chosen else rejection_type(rewards[r], rewards[c], single_hop)
            if kind:
                pairs.append((c, r, kind))
                break
    return pairs


# --------------------------------------------------------------------------- 6. the agent loop [§4.2, Fig. 3]
@dataclass
class ReasoningPath:
    """One path P_k: ids after the prompt, loss_mask (1 on generated tokens), text, contexts, parse_path's, rewards."""

    row: dict
    prompt: list
    ids: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    text: str = ""
    contexts: list = field(default_factory=list)
    retrieved: int = 0
    calls: int = 0
    done: bool = False
    forced: bool = False
    steps: list = field(default_factory=list)
    answer: str = ""
    format_ok: bool = False
    rewards: tuple = ()

    def append(self, ids, text, trained):
        self.ids, self.mask, self.text = self.ids + list(ids), self.mask + [int(trained)] * len(ids), self.text + text

    def sequence(self):
        """(ids, loss_mask) of the prompt and the path, what DPO trains on."""
        return self.prompt + self.ids, [0] * len(self.prompt) + self.mask


def add_format_tokens(model, tokenizer):
    """<Reference> and </Reference> as single tokens [Fig. 4] (and the toy tokenizer's format words); the new ids."""
    from tokenizers import AddedToken

    # impl: not "special", so decoding keeps them and the stop string <Reference> is found in the decoded text
    new = [AddedToken(t, normalized=False) for t in (REF_OPEN, REF_CLOSE) if len(tokenizer.tokenize(t)) != 1]
    new += toy.format_tokens(unknown_words(tokenizer, FORMAT_WORDS))  # none for a real tokenizer
    if new:
        tokenizer.add_tokens(new)
        model.resize_token_embeddings(len(tokenizer))
    return [tokenizer.convert_tokens_to_ids(t.content) for t in new]


def cut_step(ids, tokenizer):
    """At the step cap [§5.1.3: k <= 5] (ours): the turn's ids and text before its last "Step i:" (or <Reference>)."""
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=True)
    text = decode(ids)
    end = ([m.start() for m in STEP_START.finditer(text)] or [text.rfind(REF_OPEN)])[-1]
    cut = next((j - 1 for j in range(1, len(ids) + 1) if len(decode(ids[:j])) > end), len(ids))
    return ids[:cut], decode(ids[:cut])


def model_turn(p, ids, text, tokenizer, args):
    """The model's turn in path p [§4.2.1-4.2.2, Fig. 3]: a summary, then a step header to retrieve for (returned) or
    the final answer (None). At the step cap [§5.1.3: k <= 5] a 6th header is cut, "Final answer:" forced (ours)."""
    p.calls += 1
    capped = not p.forced and len(p.contexts) == args.max_steps and text.rstrip().endswith(REF_OPEN)
    if capped:
        ids, text = cut_step(ids, tokenizer)
    p.append(ids, text, trained=True)
    if capped:
        p.append(tokenizer("\nFinal answer:", add_special_tokens=False)["input_ids"], "\nFinal answer:", False)
        p.forced = True
        return None
    header = parse_header(text) if not p.forced and text.rstrip().endswith(REF_OPEN) else None
    if header is None or not header.subquery:
        p.done = True  # the final answer (EOS), out of tokens, or a malformed step header (format reward 0)
        return None
    return header


def add_context(p, context, tokenizer):
    """The environment's turn [§4.2.5, Fig. 4a]: the context C_q retrieved for p's step as its Reference block."""
    block = reference_block(context)
    block_ids = tokenizer(block, add_special_tokens=False)["input_ids"]
    p.append(block_ids, block, trained=False)  # simplification: </Reference> masked too (header item 5)
    p.contexts.append(context)
    p.retrieved += len(block_ids)


def rollout(model, tokenizer, system, rows, args, n_samples=1, greedy=True, seed=0):
    """n_samples reasoning paths per question [§4.2, Fig. 3], each turn one generate call and one retrieval for all."""
    prompts = encode_prompts(tokenizer, [r["question"] for r in rows], args.templates)
    paths = [ReasoningPath(r, p) for r, p in zip(rows, prompts) for _ in range(n_samples)]
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=not greedy, temperature=args.temperature)
    for turn_seed in range(seed, seed + args.max_steps + 2):  # at most 5 retrievals, a 6th header cut, the answer
        live = [p for p in paths if not p.done]
        if not live:
            break
        gen = generate(model, tokenizer, [p.prompt + p.ids for p in live], **sampling, stop=[REF_OPEN], seed=turn_seed)
        headers = [model_turn(p, ids, text, tokenizer, args) for p, ids, text in zip(live, gen.token_ids, gen.texts)]
        asking = [(p, h) for p, h in zip(live, headers) if h is not None]
        contexts = system.retrieve([h.subquery for _, h in asking], [h.entities for _, h in asking]) if asking else []
        for (p, _), context in zip(asking, contexts):
            add_context(p, context, tokenizer)
    for p in paths:
        parsed = parse_path(p.text)
        p.steps, p.answer = parsed["steps"], parsed["answer"]
        p.format_ok = parsed["format_ok"] and not p.forced and len(p.steps) == len(p.contexts)
    return paths


# --------------------------------------------------------------------------- 7. SFT data [§4.3.1]
def sft_steps(row, system, rng):
    """The reasoning steps of a question from its decomposition (metadata sub_queries, sub_answers and one supporting
    passage per step), or None: (1) supporting triplets, (2) entities, (3) subquery, (4) context, (5) summary."""
    meta = row.get("metadata") or {}
    subs, answers, doc_ids = (meta.get(k) or [] for k in ("sub_queries", "sub_answers", "supporting_doc_ids"))
    if not subs or not len(subs) == len(answers) == len(doc_ids) or any(str(d) not in system.docs for d in doc_ids):
        return None  # no decomposition, or a step without its passage (an unanswerable question)
    steps = []
    for sub, answer, doc in zip(subs, answers, doc_ids):
        # simplification: the decomposition's subquery as written, placeholders #k filled (header item 2)
        sub = re.sub(r"#(\d+)", lambda m: answers[int(m[1]) - 1] if int(m[1]) <= len(answers) else m[0], sub)
        ends = lambda t: (norm_name(t["head"]), norm_name(t["tail"]))
        # simplification: (1) the passage's triplets that hold the answer, not an LLM's choice (header item 3)
        support = [t for t in system.kg.by_doc[str(doc)] if norm_name(answer) in ends(t)]
        names = [v for t in support for v in (t["head"], t["tail"]) if norm_name(v) in norm_name(sub)]
        # simplification: (2) of their entities, those the subquery names, as Tab. 11 and Eq. 8 want (header item 4)
        entities = list(dict.fromkeys(names))
        if not support or not entities:
            return None
        context, gold = [system.chunk(doc)], {("chunk", str(doc))} | {("triplet", t["id"]) for t in support}
        others = system.retrieve([sub], [entities])[0] if system.args.sft_distractors else []
        others = [it for it in others if (it["kind"], it["id"]) not in gold][: system.args.sft_distractors]
        for t in support + others:  # (4) the golden paragraph, triplets (and distractors) at random places
            context.insert(rng.randint(0, len(context)), t)
        facts, template = " and ".join(item_text(t) for t in support), rng.choice(SUMMARIES)  # (5)
        steps.append(dict(entities=entities, subquery=sub, context=context, answer=answer, facts=facts))
        steps[-1].update(template=template, summary=template.format(facts=facts, answer=answer))
    return steps


def sft_examples(rows, system, args, rng):
    """SFT paths as (question, [(text, trained)]): whole paths, and each step as a 1-hop question [§4.3.1, Tab. 1]."""
    out = []
    for row in rows:
        steps = sft_steps(row, system, rng)
        if not steps:
            continue
        items = [(row["question"], steps, row["golden_answers"][0])]
        if args.sft_single_steps and len(steps) > 1:
            items += [(s["subquery"], [s], s["answer"]) for s in steps]
        for question, path, answer in items:
            segments = []
            for i, s in enumerate(path, 1):
                header, block = step_header(i, s["entities"], s["subquery"]), reference_block(s["context"])
                # the last summary implies the path's answer [Tab. 11]: a comparison's, not its last step's (ours)
                summary = s["template"].format(facts=s["facts"], answer=answer) if i == len(path) else s["summary"]
                segments += [(header, True), (block, False), (f"Summary: {summary}\n", True)]
            out.append((question, segments + [(f"Final answer: {answer}", True)]))
    return out


def sft_sequence(example, tokenizer, args, rng, world):
    """(ids, loss_mask) of an SFT path: 0 on the prompt and the Reference blocks, 1 on the model's text and EOS."""
    question, segments = example
    texts = [question] + [text for text, _ in segments]
    texts = toy.renamed(texts, world, rng, args.augment_p)  # toy world only (header item 12)
    ids = encode_prompts(tokenizer, texts[:1], args.templates)[0]
    mask = [0] * len(ids)
    for text, (_, trained) in zip(texts[1:], segments):
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + part, mask + [int(trained)] * len(part)  # [Eq. 4] the Reference content is masked
    return ids + [tokenizer.eos_token_id], mask + [1]


# --------------------------------------------------------------------------- 8. losses [Eq. 4, 15-17]
def sequence_logps(model, seqs, pad_id, device):
    """Summed log-probs of the loss_mask tokens of each (ids, loss_mask) sequence and their counts, (B,) each."""
    ids = right_pad([s[0] for s in seqs], pad_id).to(device)  # (B, T)
    attention = right_pad([[1] * len(s[0]) for s in seqs], 0).to(device)  # (B, T)
    mask = right_pad([s[1] for s in seqs], 0).to(device)[:, 1:].float()  # (B, T-1) shifted with the labels
    logits = model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return (logp * mask).sum(-1), mask.sum(-1)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta):
    """-log sigmoid(beta [(pi_c - ref_c) - (pi_r - ref_r)]) on summed masked log-probs, (B,) [Eq. 16]."""
    margin = beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected))  # (B,)
    return -F.logsigmoid(margin), margin


def sft_nll(logp_sums, n_tokens):
    """L_SFT [Eq. 15] of chosen paths: minus their summed log-probs over `n_tokens`, the whole batch's loss tokens."""
    # simplification: a token mean, not Eq. 15's sum per path, so that eta weighs it like a mean (header item 6)
    return -logp_sums.sum() / n_tokens


def l_all(pi_chosen, pi_rejected, ref_chosen, ref_rejected, eta, beta, n_pairs, n_tokens):
    """L_ALL = L_DPO + eta L_SFT [Eq. 17] of some of a batch's pairs as their share of the batch's (L_DPO [Eq. 16] over
    its n_pairs, L_SFT [Eq. 15] over its n_tokens); and the pairs' L_DPO and margins, (b,) each."""
    l_dpo, margin = dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta)
    return eta * sft_nll(pi_chosen, n_tokens) + l_dpo.sum() / n_pairs, l_dpo, margin


# --------------------------------------------------------------------------- 9. SFT and IP-DPO training
def adamw(accelerator, model, lr, weight_decay, steps):
    """AdamW [§5.1.3] with a linear decay to 0 over `steps` and no warm-up (ours: the paper gives no schedule)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / max(steps, 1)))
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler


def sft(accelerator, model, tokenizer, examples, args, world, out, stage="sft"):
    """Masked next-token loss on the SFT paths [Eq. 4, §5.1.3]; the mean loss logged 20 times, as <stage>/loss."""
    rng = random.Random(args.seed)
    steps = args.sft_steps or math.ceil(len(examples) / args.sft_batch_size)  # [§5.1.3] one epoch, a short last batch
    model, optimizer, scheduler = adamw(accelerator, model, args.sft_lr, args.weight_decay, steps)
    model.train()
    order, losses, logged, mb = [], [], 0, args.micro_batch_size
    bar = runs.progress(range(steps), stage, disable=not accelerator.is_local_main_process)
    for step in bar:
        if not order or (len(order) < args.sft_batch_size and args.sft_steps):
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = order[: args.sft_batch_size], order[args.sft_batch_size :]
        own, weight = runs.own_share(batch, accelerator)  # the same order on every process, its share
        seqs = [sft_sequence(examples[i], tokenizer, args, rng, world) for i in own]
        ids = right_pad([x for x, _ in seqs], tokenizer.pad_token_id)  # (B, T)
        labels = right_pad([[t if m else -100 for t, m in zip(x, mask)] for x, mask in seqs], -100)  # mask 0: -100
        attention = right_pad([[1] * len(x) for x, _ in seqs], 0)  # (B, T)
        # [Eq. 4] in micro-batches, no gradient clipping (the paper states none); simplification: the token mean over
        # the batch, not a sum (header item 6)
        loss = runs.sft_step(accelerator, model, optimizer, scheduler, ids, labels, attention, mb, math.inf, weight)
        losses.append(loss)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
        if (step + 1) % max(steps // 20, 1) == 0 or step + 1 == steps:  # the mean since the last line
            recent, logged = losses[logged:], len(losses)
            line = {f"{stage}/step": step + 1, f"{stage}/loss": sum(recent) / len(recent)}
            runs.log_update(accelerator, out, line, step + 1)
    return accelerator.unwrap_model(model), steps


def sample_round(model, tokenizer, system, rows, args, seed, name):
    """R sampled paths per question with their rewards, and the pairs built from them [§4.3.2]."""
    paths, pairs, kinds = [], [], Counter()
    model.eval()
    bar = runs.progress(range(0, len(rows), args.rollout_batch), name, not PartialState().is_local_main_process)
    for i in bar:
        part = rows[i : i + args.rollout_batch]
        batch = rollout(model, tokenizer, system, part, args, args.n_rollouts, False, seed + i)
        for q in range(0, len(batch), args.n_rollouts):
            group = batch[q : q + args.n_rollouts]
            evidence = golden_evidence(group[0].row, system.docs)
            for p in group:
                p.rewards = path_rewards(p, evidence, system.sim)
            for c, r, kind in build_pairs([p.rewards for p in group], single_hop=not evidence):
                pairs.append((group[c], group[r]))
                kinds[kind] += 1
        paths += batch
    model.train()
    return paths, pairs, kinds


def dpo_round(accelerator, model, tokenizer, pairs, eta, epochs, args, rng):
    """DPO [Eq. 16] + eta SFT on the chosen paths [Eq. 15, 17], the model at the round's start as the reference, on
    `pairs` ((ids, loss_mask) chosen, (ids, loss_mask) rejected) that every process holds, dpo_batch_size a step."""
    device, pad, mb = model.device, tokenizer.pad_token_id, args.micro_batch_size
    logps = lambda part: sequence_logps(model, [s for pair in part for s in pair], pad, device)[0].view(-1, 2).tolist()
    in_micro_batches = lambda part: [r for i in range(0, len(part), mb) for r in logps(part[i : i + mb])]
    model.eval()
    with torch.no_grad():  # the reference Theta_{p-1}, the model that sampled the round [Eq. 16], over the processes
        ref = torch.tensor(runs.map_shared(in_micro_batches, pairs), device=device).view(-1, 2)  # (n_pairs, 2)
    n_steps = epochs * math.ceil(len(pairs) / args.dpo_batch_size)
    model, optimizer, scheduler = adamw(accelerator, model, args.dpo_lr, args.weight_decay, n_steps)
    model.train()
    stats = defaultdict(list)
    for _ in range(epochs):
        order = rng.sample(range(len(pairs)), len(pairs))  # the same on every process
        for b in range(0, len(order), args.dpo_batch_size):
            optimizer.zero_grad()
            batch = order[b : b + args.dpo_batch_size]
            for name, value in dpo_backward(accelerator, model, pairs, ref, batch, eta, args, pad).items():
                stats[f"losses/{name}"].append(value)
            optimizer.step()
            scheduler.step()
    return accelerator.unwrap_model(model), {k: sum(v) / len(v) for k, v in stats.items()}, n_steps


def dpo_backward(accelerator, model, pairs, ref, batch, eta, args, pad):
    """The gradient of L_ALL [Eq. 17] on `batch` (pair indices, the same on every process) and its losses, from this
    process's share in micro-batches: any micro-batch size and process count give the batch's gradient."""
    own, weight = runs.own_share(batch, accelerator)
    n_tokens = max(sum(sum(pairs[i][0][1][1:]) for i in batch), 1)  # the chosen paths' loss tokens, as sequence_logps
    sums = torch.zeros(4, device=accelerator.device)  # L_DPO, -log p of the chosen, margin, margin > 0 over own pairs

    def loss_of(rows):
        part = own[rows]
        seqs = [pairs[i][0] for i in part] + [pairs[i][1] for i in part]  # chosen, then rejected
        pi_c, pi_r = sequence_logps(model, seqs, pad, accelerator.device)[0].chunk(2)  # (b,) each
        loss, l_dpo, margin = l_all(pi_c, pi_r, ref[part, 0], ref[part, 1], eta, args.beta, len(batch), n_tokens)
        sums.add_(weight * torch.stack([l_dpo.sum(), -pi_c.sum(), margin.sum(), (margin > 0).float().sum()]).detach())
        return loss * accelerator.num_processes * weight

    runs.micro_backward(accelerator, model, len(own), args.micro_batch_size, loss_of)
    dpo, nll, margin, right = (runs.global_sum(accelerator, sums) / len(batch)).tolist()  # per pair
    sft = nll * len(batch) / n_tokens  # per chosen token
    return {"dpo": dpo, "sft": sft, "all": eta * sft + dpo, "margin": margin, "accuracy": right}


# --------------------------------------------------------------------------- 10. evaluation [§5.1.1, §5.3.2]
def path_record(p):
    """What one greedy path scored and cost, tokens counted as the paper counts them [§5.3.2]."""
    golds, k = p.row["golden_answers"], len(p.contexts)
    thinking = sum(p.mask)  # the model's own tokens (loss_mask 1), not the environment's forced "Final answer:"
    supporting = {str(i) for i in (p.row.get("metadata") or {}).get("supporting_doc_ids") or []}
    seen = {it["doc_id"] for ctx in p.contexts for it in ctx}
    record = answer_scores(p.answer, golds)  # FlashRAG's EM and F1 (the paper's metrics) and sub-EM
    record |= {"format": float(p.format_ok), "retrievals": k, "llm_calls": p.calls, "generated_tokens": thinking}
    record |= {"thinking_tokens": thinking, "retrieved_tokens": p.retrieved, "total_tokens": len(p.ids)}  # [§5.3.2]
    record["content_per_retrieval"] = p.retrieved / k if k else 0.0  # CpR
    return record | {"evidence_recall": len(supporting & seen) / len(supporting) if supporting else 1.0}


@runs.evaluation
def evaluate(model, tokenizer, system, rows, args, predictions=None):
    """Greedy paths on the held-out questions: EM, F1, steps and tokens per question, overall and by metadata group."""
    model.eval()
    size, main = 2 * args.rollout_batch, PartialState().is_local_main_process
    bar = runs.progress(range(0, len(rows), size), "eval", disable=not main, leave=False)
    paths = [p for i in bar for p in rollout(model, tokenizer, system, rows[i : i + size], args, seed=i)]
    model.train()
    records = [path_record(p) for p in paths]
    if predictions is not None and PartialState().is_main_process:
        row = lambda p: {"id": p.row.get("id"), "question": p.row["question"], "golds": p.row["golden_answers"]}
        lines = [row(p) | {"prediction": p.answer, "path": p.text} | r for p, r in zip(paths, records)]
        write_jsonl(predictions, lines)
    return summarize(records, [p.row for p in paths])


# the table that ends a run: EM, F1, steps and tokens per question at each stage [§5.3.2, Tab. 3]
ROWS = ("em", "f1", "format", "retrievals", "llm_calls", "thinking_tokens", "retrieved_tokens", "total_tokens")


STAGES = {"raw": "raw start", "sft": "after SFT", "dpo": "after IP-DPO", "eval": "eval"}


def evaluate_stage(accelerator, out, stage, model, tokenizer, system, rows, args, step=None):
    """The greedy evaluation of a stage (raw, sft, dpo, eval) with predictions_<stage>.jsonl and a log line."""
    with accelerator.autocast():
        result = evaluate(model, tokenizer, system, rows, args, out / f"predictions_{stage}.jsonl")
    scores = f"em={result['em']:.3f} f1={result['f1']:.3f} format={result['format']:.2f} "
    cost = f"steps={result['retrievals']:.2f} thinking={result['thinking_tokens']:.1f}"
    accelerator.print(f"{STAGES[stage]} | {scores}{cost} retrieved={result['retrieved_tokens']:.1f}")
    if step is not None:
        runs.log_eval(accelerator, out, stage, result, step)
    return result


# --------------------------------------------------------------------------- 11. train / eval / ask
def load_policy(args, device):
    """The policy LLM with the format tokens (and LoRA r, alpha 32, dropout 0.1 on q/k/v/o when lora_r > 0)."""
    # fp32 master weights, bf16 autocast (accelerate); only a frozen LoRA base may be stored in bf16
    dtype = torch.bfloat16 if device.type == "cuda" and args.lora_r else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, world=args.world)
    new_ids = add_format_tokens(model, tokenizer)
    if args.lora_r and not hasattr(model, "peft_config"):
        lora = {"r": args.lora_r, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["q_proj", "k_proj"]}
        lora["target_modules"] += ["v_proj", "o_proj"]  # [§5.1.3]
        # simplification: one adapter through SFT and every round, never merged (header item 7); new token rows trained
        model = add_lora(model, lora | ({"trainable_token_indices": new_ids} if new_ids else {}))
    for p in model.parameters():  # never Adam on bf16 weights
        if p.requires_grad:
            p.data = p.data.float()
    return model.to(device), tokenizer


def round_stats(rnd, paths, kinds, pairs, seconds):
    """What a round's sampling logs (Table 8: # pairs, # steps)."""
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    stats = {"round": rnd, "pairs": pairs, **{f"pairs/{k}": v for k, v in sorted(kinds.items())}}
    for i, name in enumerate(("format", "outcome", "process")):
        stats[f"rollout/{name}"] = mean([p.rewards[i] for p in paths])
    stats["rollout/steps"] = mean([len(p.contexts) for p in paths])
    stats["rollout/thinking_tokens"] = mean([sum(p.mask) for p in paths])
    return stats | {"charts/seconds": seconds}


def train(args):
    """SFT, then the IP-DPO rounds (sample, score, pair, DPO + SFT), evaluations before and after; --resume."""
    start, (accelerator, out) = time.time(), runs.start(args, "tearag")
    sft_rows = load_split(args.data_dir, args.sft_split, args.sft_types)
    dpo_rows = sample_rows(load_split(args.data_dir, args.dpo_split, args.dpo_types), args.n_dpo, args.seed)
    test_rows = load_split(args.data_dir, "test")[: args.n_eval]
    system = RetrievalSystem(args, accelerator.device)
    if single := sum("hops" not in (r.get("metadata") or {}) for r in dpo_rows):  # no golden evidence [§4.3.2]
        accelerator.print(f"note: {single} of {len(dpo_rows)} IP-DPO questions lack metadata hops: scored single-hop")
    stages, steps = {"warnings": []}, {"sft": 0, "dpo": 0}
    saved = lambda rnd: {"method": "tearag", "world": args.world, "data_dir": args.data_dir, "args": asdict(args),
                         "stages": stages, "steps": steps, "round": rnd}  # fmt: skip
    if state := runs.load_training(accelerator, out / "dpo", {}) or runs.load_training(accelerator, out / "sft", {}):
        last = str(out / ("dpo" if state["round"] else "sft"))  # --resume from the last checkpoint
        model, tokenizer = load_policy(replace(args, model=last), accelerator.device)
        stages, steps = {"warnings": []} | state["stages"], state["steps"]
    else:
        if not (examples := sft_examples(sft_rows, system, args, random.Random(args.seed))):
            need = "metadata sub_queries, sub_answers and supporting_doc_ids (passages in the corpus)"
            raise UserError(f"{args.data_dir}/{args.sft_split}.jsonl: no row with a decomposition ({need}) for SFT")
        model, tokenizer = load_policy(args, accelerator.device)
        stages["before_sft"] = evaluate_stage(accelerator, out, "raw", model, tokenizer, system, test_rows, args)
        accelerator.print(f"SFT: {len(examples)} paths from {len(sft_rows)} questions")
        # simplification: toy renaming (header item 12)
        world = load_world(args.world) if args.augment_p and args.world else None
        if args.sft_curriculum:  # simplification: the toy SFT starts on comparison paths (header item 13)
            first, stage = toy.curriculum(args, sft_rows, partial(sft_examples, system=system, args=args))
            accelerator.print(f"curriculum: {len(first)} paths of {args.sft_curriculum.split(':')[0]} first")
            model, steps["curriculum"] = sft(accelerator, model, tokenizer, first, stage, world, out, "curriculum")
        model, steps["sft"] = sft(accelerator, model, tokenizer, examples, args, world, out)
        stages["before"] = evaluate_stage(accelerator, out, "sft", model, tokenizer, system, test_rows, args, 0)
        state = saved(0)
        runs.save_training(accelerator, out / "sft", model, tokenizer, state, {})
    etas = runs.per_round(args.eta, args.rounds, "--eta")  # the first --rounds values (apply_preset checked them)
    epochs = [int(e) for e in runs.per_round(args.dpo_epochs, args.rounds, "--dpo_epochs")]
    shard = dpo_rows[accelerator.process_index :: accelerator.num_processes]
    curve = lambda rows: evaluate(model, tokenizer, system, rows, args)  # the model of the round (greedy [§5.1.3])
    if state["round"] == 0:  # the curve's start: the SFT model
        runs.curve_point(accelerator, out, args, 0, curve)
    for rnd in range(state["round"], args.rounds):  # Theta_p from Theta_{p-1} [§4.3.2]
        t0, seed = time.time(), args.seed * 100_003 + rnd * 7919 + accelerator.process_index
        with accelerator.autocast():
            paths, pairs, kinds = sample_round(model, tokenizer, system, shard, args, seed, f"round {rnd + 1}")
        pairs = gather_object([(c.sequence(), r.sequence()) for c, r in pairs])  # every process: every pair, in order
        kinds = sum(gather_object([kinds]), Counter())
        if not pairs:
            runs.nothing_to_train(accelerator, stages["warnings"], f"IP-DPO round {rnd + 1}", "0 preference pairs")
        rng = random.Random(args.seed + rnd)
        model, stats, n_steps = dpo_round(accelerator, model, tokenizer, pairs, etas[rnd], epochs[rnd], args, rng)
        stats |= round_stats(rnd + 1, paths, kinds, len(pairs), time.time() - t0)
        runs.log_update(accelerator, out, stats, step=rnd + 1)
        steps["dpo"] += n_steps
        stages.setdefault("rounds", []).append(stats)
        runs.curve_point(accelerator, out, args, rnd + 1, curve)
        runs.save_training(accelerator, out / "dpo", model, tokenizer, saved(rnd + 1), {})
    stages["after"] = evaluate_stage(accelerator, out, "dpo", model, tokenizer, system, test_rows, args, args.rounds)
    accelerator.end_training()
    wall, before_sft = time.time() - start, stages.get("before_sft")
    results = runs.result_record("tearag", args, before_sft, stages["before"], stages["after"], steps, wall)
    results |= {"rounds": stages.get("rounds", []), "warnings": stages["warnings"]}
    runs.write_results(out, results, accelerator.is_main_process, rows=ROWS)


def run_eval(args):
    """Evaluate --model (a checkpoint folder, or the untrained start) on the test split, in a folder of its own."""
    start, rows = time.time(), load_split(args.data_dir, "test")[: args.n_eval]  # a bad data file fails first
    accelerator, out = runs.start_eval(args)
    accelerator.print(f"evaluation folder: {out}")
    system = RetrievalSystem(args, accelerator.device)  # a bad corpus or graph fails before the model loads
    model, tokenizer = load_policy(args, accelerator.device)
    result = evaluate_stage(accelerator, out, "eval", model, tokenizer, system, rows, args)
    results = runs.result_record("tearag", args, None, result, None, {"sft": 0, "dpo": 0}, time.time() - start)
    runs.write_results(out, results | {"rounds": [], "warnings": []}, accelerator.is_main_process, rows=ROWS)


def ask(args):
    """One question through the agent loop (greedy), printing the reasoning path."""
    device = runs.make_accelerator().device
    model, tokenizer = load_policy(args, device)
    if unknown := unknown_words(tokenizer, args.ask):
        print(f"warning: words the model's tokenizer does not know (read as <unk>): {' '.join(unknown)}")
    row = {"id": "ask", "question": args.ask, "golden_answers": [""], "metadata": {}}
    path = rollout(model.eval(), tokenizer, RetrievalSystem(args, device), [row], args)[0]
    print(path.text.strip())
    print(f"answer: {path.answer} | steps: {len(path.contexts)} | format ok: {path.format_ok}")


def main(argv=None):
    """Parse the flags, fill the preset, dispatch on the mode."""
    if (flags := runs.parse_flags(Args, argv, PRESETS)).extract_triples:  # the knowledge graph [§4.1]
        if flags.train or flags.eval or flags.ask:
            raise SystemExit("--extract_triples is a mode of its own: run it apart from --train, --eval and --ask")
        return extract_triples(flags)
    args = apply_preset(runs.parse_args(Args, argv, "tearag's is runs/<run_name>/dpo", "tearag", PRESETS))
    (runs.dry_run if args.dry_run else train if args.train else run_eval if args.eval else ask)(args)


if __name__ == "__main__":
    runs.run_main(main)  # a user's mistake (bad file, missing field) ends in one line, not a traceback
