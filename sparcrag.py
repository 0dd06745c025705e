# Paper: SPARC-RAG: Adaptive Sequential–Parallel Scaling with Context Management for Retrieval-Augmented
# Generation (anonymous ACL submission, no arXiv id; section and equation tags cite it). Docs: docs/sparcrag.md
"""SPARC-RAG: depth (rounds) and width (branches) of RAG scaled around one shared note; DPO on process preferences.

One backbone plays every agent [§3.2, App. D]. Each round of Algorithm 1, the Query Rewriter writes W complementary
sub-queries in one call, each naming its retriever (bm25 or dense); each opens an isolated branch that retrieves,
lets the Context Manager fold the passages into a copy of the global note, answers the question from that note
(Answer Generator) and judges the answer (Answer Evaluator: STOP or CONTINUE). The Context Manager then selects the
best branch and merges the notes, winner first, into the new global note, the only write to the shared context; the
loop ends on the winner's STOP or at depth D. Tuning [§3.4]: pairs from the model's own runs (rewrite sets of higher
gold-paragraph recall over lower ones; decisions matching the answer's correctness over the opposite, a continue over
a wrong stop weighted lambda = 2), trained by weighted DPO with LoRA against the adapter-disabled model.

    python sparcrag.py --train --run_name sparcrag        # toy world: warm-up SFT, pair collection, DPO, evaluations
    python sparcrag.py --eval --model runs/sparcrag/dpo     # the tuned system (adaptive depth) on the toy test split
    python sparcrag.py --eval --model runs/sparcrag/sft --early_exit false --depth 4 --width 1   # untuned, fixed W x D
    python sparcrag.py --ask "what is the birthplace of the director of poli ?" --model runs/sparcrag/dpo
    accelerate launch sparcrag.py --train --preset paper --data_dir DATA --bm25_index IDX1 --dense_index IDX2

Departures from the paper, in both presets (each marked `# simplification: ... (header item N)` where it lives):
1. The Answer Evaluator's prompt is ours: the paper describes the agent (§3.2) but prints no prompt (App. D).
2. DPO against the adapter-disabled model (TRL 0.23.1's DPO with LoRA, App. A.4); §3.4's printed loss has no reference.
3. Paper preset: BM25 and E5 over wiki-18 (the paper: Elasticsearch BM25, BGE-large-en-v1.5, IRCoT and DPR corpora).
4. Cost: all roles' tokens in the trained model's tokenizer; latency batched; App. B.2's overlap on the branches' sets.
5. W = 1 calls no Select or Merge (Alg. 1 calls both every round): the one branch's note is m^(t), its answer a_k*.
6. One seed per batched generate call: a sample depends on its batch-mates (per-question seeds: a call each).

Toy-world adaptations, the toy preset only (numbered on; in parentheses the PRESETS fields that realise each):
7. The trained roles are a tiny toy-lm; the Context Manager and Answer Generator the toy reader (model, llm).
8. Untuned start: SFT on an oracle teacher that over-accepts, writes near-duplicates (§5.2, Fig. 7) (sft_*, teacher_*).
9. Warm-up SFT examples and DPO pairs entity-renamed: a tiny model learns to copy names only then (augment_p).
10. Greedy, top-3, depths 4 (paper: T 0.5, 6, 6/8); compact single-token tags (templates, format_tokens, evaluator_*).
11. EM labels correctness (evaluator pairs, incorrect acceptance): FlashRAG's acc finds "no" in "unknown" (correct_by).
12. Wrong-stop weight lambda = 8 (paper: 2; Fig. 6): at DPO lr 5e-5 a smaller one leaves "unknown" stops (lam).
13. A LoRA adapter per trained role (paper: one), the rewriter's 1 epoch, the evaluator's 5 (role_adapters, *_epochs).
"""

import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.utils import gather_object

from common import runs
from common.data import load_split, sample_rows, write_jsonl
from common.llm import add_lora, chat_prompts, generate, right_pad, unknown_words
from common.metrics import answer_scores, exact_match, f1_score, normalize_answer, sub_exact_match
from common.models import load_model_and_tokenizer, make_llm
from common.retrieval import open_retriever
from common.toy import sparcrag as toy  # the toy world's teacher, warm-up, renaming, adapters (header items 8-13)


@dataclass
class Args:
    preset: str = runs.arg("toy", "toy (toy world, tiny model, CPU) or paper", choices=["toy", "paper"], group="run")
    train: bool = runs.arg(False, "warm-up (toy), preference pairs, DPO, evaluations")
    eval: bool = runs.arg(False, "evaluate --model (a checkpoint or the untrained start)")
    ask: str = runs.arg("", "answer one question with --model and print every agent call")
    output_dir: str | None = runs.arg(None, "default: runs/<run_name>; --eval: <model>/eval/<data>-<time>")
    run_name: str | None = runs.arg(None, "a training run's name: sparcrag__<seed>__<time>")
    resume: bool = runs.arg(False, "continue the run --run_name / --output_dir")
    dry_run: bool = runs.arg(False, "print the configuration, check its paths, load nothing")
    report_to: str = runs.arg("none", "tracker", choices=["none", "tensorboard", "wandb"])
    seed: int = runs.arg(42, "seed of models, sampling and data order [App. A.4: 42]")
    data_dir: str | None = runs.arg(None, "folder with train/test jsonl (FlashRAG QA)", group="data and models")
    world: str | None = runs.arg(None, runs.WORLD_HELP)
    corpus: str | None = runs.arg(None, "corpus jsonl (default: data_dir/corpus.jsonl)")
    bm25_index: str = runs.arg("", "saved BM25 folder (empty: built over --corpus) [App. A.3]")
    dense_index: str = runs.arg("", "saved dense retriever folder [App. A.2: BGE-large]")
    encoder: str | None = runs.arg(None, "dense encoder when --dense_index is empty")
    model: str | None = runs.arg(None, "the backbone [§4.2: Qwen2.5-7B-Instruct]")
    llm: str | None = runs.arg(None, "untrained roles: policy [§4.2], toy, hf:<name> or a URL")
    llm_model: str = runs.arg("", "served model name when --llm is an endpoint URL")
    n_train: int | None = runs.arg(None, "training questions (None: all)", low=1)
    n_eval: int | None = runs.arg(None, "test questions evaluated (None: all) [§4.1: 500]", low=1)
    width: int = runs.arg(2, "W, branches per round [§4.5: 2]", low=1, group="Algorithm 1 [§3.3, §4.5, App. A]")
    depth: int | None = runs.arg(None, "D_max, rounds at most [§4.5: 8]", low=1)
    untuned_depth: int | None = runs.arg(None, "fixed depth of the untuned system [§4.5: 6]", low=1)
    early_exit: bool = runs.arg(True, "stop on the winner's STOP (false: fixed depth) [§4.5]")
    top_k: int | None = runs.arg(None, "passages per retrieval [App. A.3: 6]", low=1)
    temperature: float | None = runs.arg(None, "generation modules [App. A.4: 0.5]", low=0.0)
    max_new_tokens: int | None = runs.arg(None, "tokens per agent call [App. A.4: 600]", low=1)
    dense_only: bool = runs.arg(False, "every query dense (the Tab. 6 ablation)")
    gen_batch_size: int = runs.arg(512, "prompts per generate call (memory only)", low=1)
    n_samples: int = runs.arg(4, "samples per state [§3.4; ours: 4]", low=1, group="preference pairs [§3.4]")
    lam: float | None = runs.arg(None, "weight of continue over a wrong stop [§5.2: 2]", low=1.0)
    synthesize_missing: bool = runs.arg(False, "missing side -> canonical decision (ours)")
    beta: float = runs.arg(0.1, "DPO beta [App. A.4: 0.1]", low=1e-9, group="DPO with LoRA [App. A.4]")
    reference_free: bool = runs.arg(False, "the paper's equation as printed: no reference")
    lora_r: int = runs.arg(16, "LoRA rank [App. A.4: 16]", low=1)
    lora_alpha: int = runs.arg(32, "LoRA alpha [App. A.4: 32]", low=1)
    dpo_lr: float = runs.arg(5e-5, "DPO learning rate [App. A.4: 5e-5 (LoRA)]", low=1e-9)
    dpo_epochs: int | None = runs.arg(None, "DPO epochs (per-role adapters: the rewriter's) [A.4: 3]", low=1)
    dpo_batch_size: int = runs.arg(16, "pairs per update [App. A.4: effective 16]", low=1)
    micro_batch_size: int | None = runs.arg(None, "pairs per forward (accumulation)", low=1)
    sft_steps: int | None = runs.arg(None, "toy teacher SFT steps (0: none, the paper)", low=0, group="warm-up")
    # set by PRESETS or fixed, not flags: constants the paper never varies, choices of ours, toy-world tuning
    lora_dropout: float = runs.arg(0.05, "LoRA dropout [App. A.4: 0.05]", flag=False)
    max_length: int = runs.arg(8192, "longest pair sequence kept [App. A.4: 8192]", flag=False)
    templates: str | None = runs.arg(None, "paper (App. D verbatim) or compact (header item 10)", flag=False)
    format_tokens: bool | None = runs.arg(None, "the formats' tags as single tokens (header item 10)", flag=False)
    evaluator_max_tokens: int | None = runs.arg(None, "tokens per evaluator call (None: --max_new_tokens)", flag=False)
    correct_by: str | None = runs.arg(None, "answer correctness: acc or em (header item 11)", flag=False)
    role_adapters: bool | None = runs.arg(None, "one LoRA adapter per trained role (header item 13)", flag=False)
    evaluator_epochs: int | None = runs.arg(None, "role_adapters: the evaluator adapter's epochs", flag=False)
    sft_batch_size: int = runs.arg(32, "warm-up SFT batch size, 32 (header item 8)", flag=False)
    sft_lr: float = runs.arg(2e-3, "warm-up SFT learning rate, 2e-3 (header item 8)", flag=False)
    warmup_widths: str = runs.arg("1,2,4", "widths of the teacher's runs, 1,2,4 (header item 8)", flag=False)
    teacher_accept_correct: float = runs.arg(0.9, "teacher: P(STOP | correct answer), 0.9 (header item 8)", flag=False)
    teacher_accept_wrong: float = runs.arg(0.6, "teacher: P(STOP | wrong answer), 0.6 (header item 8)", flag=False)
    teacher_duplicate: float = runs.arg(0.5, "teacher: P(near-duplicate rewrite set), 0.5 (item 8)", flag=False)
    augment_p: float | None = runs.arg(None, "renaming P of an SFT example, a DPO pair (header 9)", flag=False)


PRESETS = {  # field: (toy, paper), for the fields left at None; any flag overrides them
    "data_dir": ("data/toy", "data/sparcrag"),
    "encoder": ("tfidf", "intfloat/e5-base-v2"),  # simplification: E5 over wiki-18 (header item 3)
    "model": ("toy-lm", "Qwen/Qwen2.5-7B-Instruct"),  # [§4.2]; simplification: a tiny toy-lm (header item 7)
    "llm": ("toy", "policy"),  # [§4.2]; simplification: the toy reader (header item 7)
    "n_train": (400, None),
    "depth": (4, 8),  # [§4.5]; simplification: header item 10
    "untuned_depth": (4, 6),  # [§4.5]
    "top_k": (3, 6),  # [App. A.3]
    "temperature": (0.0, 0.5),  # [App. A.4]
    "max_new_tokens": (64, 600),  # [App. A.4]
    "lam": (8.0, 2.0),  # [§5.2, Fig. 6]; simplification: header item 12
    "dpo_epochs": (1, 3),  # [App. A.4: 3]; simplification: the toy rewriter's adapter, 1 epoch (header item 13)
    "micro_batch_size": (16, 1),
    "sft_steps": (800, 0),  # simplification: the toy's warm-up (header item 8); the paper tunes the model as it is
    "templates": ("compact", "paper"),  # simplification: the toy's compact set (header item 10)
    "format_tokens": (True, False),  # simplification: single-token tags for a model trained from scratch (item 10)
    "evaluator_max_tokens": (8, None),  # [App. A.4: 600, as every call]; the toy's decision tag fits 8 (item 10)
    "correct_by": ("em", "acc"),  # simplification: header item 11
    "role_adapters": (True, False),  # simplification: per-role adapters in the toy (header item 13)
    "evaluator_epochs": (5, 3),  # [App. A.4: 3]; with role_adapters (header item 13)
    "augment_p": (1.0, 0.0),  # simplification: toy renaming (header item 9)
}


def apply_preset(args):
    """Fill the fields left at None from the preset's column; every problem the flags make together, in one line."""
    for key in [key for key in PRESETS if getattr(args, key) is None]:
        setattr(args, key, PRESETS[key][args.preset == "paper"])
    args.corpus = args.corpus or str(Path(args.data_dir) / "corpus.jsonl")
    args.world = args.world or runs.toy_world(None, args.data_dir)  # the preset's data_dir may hold one
    if args.output_dir is None and args.eval:  # its own folder: never an earlier evaluation's, nor a training run's
        args.output_dir = runs.eval_dir(args, "sparcrag")
    reads = (args.train or args.eval) and not args.dry_run  # the data (a dry run checks every path itself)
    checks = {
        "--resume continues a training run: use it with --train": args.resume and not args.train,
        "--llm toy reads a toy world: pass --world DIR": args.llm == "toy" and not args.world,
        f"--data_dir {args.data_dir}: no such folder": reads and not Path(args.data_dir).is_dir(),
        f"--model {args.model}: not found": not args.dry_run and runs.where_is(args.model) is None,
    }
    if problems := [problem for problem, found in checks.items() if found]:
        raise SystemExit("; ".join(problems))
    return args


# --------------------------------------------------------------------------- 1. prompts [App. D]
CONTEXT_MANAGER_PROMPT = """\
Act as the context manager for a Retrieval-Augmented Generation (RAG) system. Your job is to maintain a single, \
up-to-date note that contains all the information relevant to answering the original query. Please ensure that the \
note includes all original text information useful for answering the question.
Steps:
- Based on the retrieved documents, supplement the notes with content not yet included but useful for answering the \
question.
- Resolve conflicts: if statements disagree, keep the most reliable or recent version.
End your response with the literal tag [END].
Original query: {query}
Old note: {note}
New information: {new_context}
Updated note:"""

ANSWER_GENERATOR_PROMPT = """\
Answer the question based on the given notes.
Output ONLY the exact answer in as few words as possible.
Do not include the question, reasoning, or any extra text.
End your response with the literal tag [END].
The following are given notes:
{note}
Question: {query}
Answer:"""

REWRITE_PROMPT = """\
You are an intelligent assistant in a Retrieval-Augmented Generation (RAG) system. Your goal is to (a) diagnose \
retrieval needs for the current question and (b) produce exactly {N} rewritten queries, each paired with the most \
suitable retrieval strategy for that specific rewrite.
Information:
- Original Query: {query}
- Current Query: {current_query}
- Context: {context}
Available Retrieval Strategies:
- bm25 (sparse / lexical): Prioritizes exact token and phrase matches.
- dense (semantic / vector similarity): Matches by meaning despite paraphrases.
Instructions:
1. Use the context to reflect on what is missing to answer the query. Think about both the big picture and the small \
atomic facts that might need verification.
2. Generate exactly {N} rewritten queries.
 - Do not just paraphrase – each query should explore a different angle, granularity, or fact.
 - Avoid near-duplicates.
 - Each query must serve a distinct retrieval purpose.
3. For each query, select the most suitable retrieval strategy:
 - Use bm25 when exact names, phrases, or quoted terms matter; remove “wh” words.
 - Use dense when searching for meanings, definitions, or related concepts.
Output Format (strict):
1. First provide your analysis and rationale in a <think> block, including per-item strategy justification.
2. Then output exactly {N} query rewrites using the following structure:
```
<queries>
<item rank="1"><strategy>bm25|dense</strategy>
<query>...</query>
</item>
<item rank="2"><strategy>bm25|dense</strategy>
<query>...</query>
</item>
...
<item rank="{N}"><strategy>bm25|dense</strategy>
<query>...</query>
</item>
</queries>
```
3. End your response with the literal tag [END].
Output:"""

ANSWER_SELECTION_PROMPT = """\
Question: {question}
All Generated Answers:
{answer_blocks}
Based on all the answers and reasoning provided, select the best answer. Consider accuracy and relevance to the \
question. Give the final answer directly. Then, provide a direct, concise, and accurate answer inside \
<answer> </answer> tags. End your response with the literal tag [END].
Final answer:"""

CONTEXT_MERGING_PROMPT = """\
You are an expert at combining contexts in a Retrieval Augmented Generation system for answering question {question}. \
Here are several notes: {reasoning_list}.
Combine the above notes into a single note that includes all information and is useful for final answer generation. \
Please ensure that the note includes all original text information useful for answering the question. End your \
response with the literal tag [END].
Your response:"""

# simplification: ours (header item 1): the paper describes the Answer Evaluator [§3.2] (inputs q0, q_t, a_t, m_t;
# STOP or CONTINUE on correctness and grounding, abstract) but prints no prompt
EVALUATOR_PROMPT = """\
You are the answer evaluator in a Retrieval-Augmented Generation (RAG) system. Decide whether the candidate answer \
can be accepted as the final answer (STOP) or whether more retrieval and reasoning are needed (CONTINUE).
Accept only if both conditions hold:
1. Correctness: the candidate answer directly and completely answers the original query, not only the current query.
2. Grounding: the facts needed to support the candidate answer are explicitly stated in the note.
Otherwise, reject.
Original query: {query}
Current query: {current_query}
Note: {note}
Candidate answer: {answer}
Give a one-sentence justification, then output your decision as <decision>STOP</decision> or \
<decision>CONTINUE</decision>. End your response with the literal tag [END].
Evaluation:"""

ROLES = ("update", "answer", "rewrite", "select", "merge", "evaluate")  # the templates' keys
PAPER_PROMPTS = (CONTEXT_MANAGER_PROMPT, ANSWER_GENERATOR_PROMPT, REWRITE_PROMPT, ANSWER_SELECTION_PROMPT)
PAPER_PROMPTS += (CONTEXT_MERGING_PROMPT, EVALUATOR_PROMPT)  # in the order of ROLES
TEMPLATES = {  # simplification: the toy preset's compact set (header item 10)
    "paper": dict(zip(ROLES, PAPER_PROMPTS)),
    "compact": toy.COMPACT_TEMPLATES,
}
STOP, CONTINUE = "STOP", "CONTINUE"
TRAINED = ("rewrite", "evaluate")  # [§3.4] the roles the preference pairs tune
TEXTS = ("prompt", "chosen", "rejected")  # a preference pair's texts
TABLE = "em f1 acc avg recall rounds llm_calls tokens generated_tokens incorrect_acceptance".split()  # [§4.1, Fig. 7]


def format_passages(hits):
    """{new_context}: `Title: t` / `Text: x` per passage, blank lines between (ours: DeepNote's format)."""
    return "\n\n".join(f"Title: {h['title']}\nText: {h['text']}" for h in hits)


def format_answer_blocks(branches):
    """{answer_blocks}: the answer, evaluation and note of each branch, 1-based (ours; [Alg. 1] L12 passes e_k)."""
    block = "Answer {0}: {1.answer}\nEvaluation {0}: {1.decision}\nReasoning {0}: {1.note}"
    return "\n\n".join(block.format(k, b) for k, b in enumerate(branches, 1))


def format_notes(notes):
    """{reasoning_list}: `Note i: ...`, the winner's note first (ours; [§3.2] ContextMerge(m'_k*, others))."""
    return "\n".join(f"Note {i}: {note}" for i, note in enumerate(notes, 1))


def format_rewrites(items):
    """A rewrite set in the Rewrite prompt's output format (without the <think> block), ending with [END]."""
    item = '<item rank="{}"><strategy>{}</strategy>\n<query>{}</query>\n</item>\n'
    body = "".join(item.format(i, s, q) for i, (s, q) in enumerate(items, 1))
    return f"<queries>\n{body}</queries> [END]"


# --------------------------------------------------------------------------- 2. parsing (ours; formats: App. D)
END = re.compile(r"\[\s*end\s*\]", re.IGNORECASE)
TAG = r"<\s*{0}\b[^>]*>(.*?)<\s*/\s*{0}\s*>"  # spacing tolerated: the toy tokenizer decodes `< query >`
FLAGS = re.DOTALL | re.IGNORECASE


def strip_end(text):
    """The text before the first [END], without <think> blocks (an unclosed one runs to the end; ours)."""
    return re.sub(r"<\s*think\s*>.*?(<\s*/\s*think\s*>|$)", " ", END.split(text, maxsplit=1)[0], flags=FLAGS).strip()


def clean_answer(text):
    """The Answer Generator's answer: the first non-empty line before [END] (ours)."""
    return next((line.strip() for line in strip_end(text).splitlines() if line.strip()), "")


def parse_rewrites(text, width, fallback=None):
    """[(strategy, query)] of a rewrite (ours): items by rank, strategy bm25 or else dense, empty and repeated items
    dropped, the first `width` padded with (dense, fallback); no fallback, no padding (an unparsed sample)."""
    found = []
    for i, m in enumerate(re.finditer(TAG.format("item"), strip_end(text), flags=FLAGS)):
        rank = re.search(r'rank\s*=\s*"?\s*(\d+)', m.group(0))
        strategy = re.search(TAG.format("strategy"), m.group(1), flags=FLAGS)
        query = re.search(TAG.format("query"), m.group(1), flags=FLAGS)
        strategy = "bm25" if strategy and strategy.group(1).strip().lower() == "bm25" else "dense"
        query = " ".join(query.group(1).split()) if query else ""
        found.append((int(rank.group(1)) if rank else i + 1, i, strategy, query))
    items = []
    for _, _, strategy, query in sorted(found):
        if query and (strategy, normalize_answer(query)) not in [(s, normalize_answer(q)) for s, q in items]:
            items.append((strategy, query))
    return items[:width] + ([] if fallback is None else [("dense", fallback)] * (width - len(items[:width])))


def parse_decision(text):
    """STOP or CONTINUE of the text before [END] without <think> blocks: the last <decision> tag, else the last bare
    word, else CONTINUE (never stop by default: an output cut inside its <think> block continues)."""
    text = strip_end(text)
    tags = re.findall(r"<\s*decision\s*>\s*(stop|continue)\s*<\s*/\s*decision\s*>", text, flags=re.IGNORECASE)
    words = tags or re.findall(r"\b(stop|continue)\b", text, flags=re.IGNORECASE)
    return words[-1].upper() if words else CONTINUE


def select_branch(text, answers, decisions):
    """k* of the Answer Selection output (ours, [§3.2]): the branch whose answer is the last <answer> text (normalised,
    not empty), else the best token-F1 one, else the first STOP branch, else 0; the lowest k on ties."""
    text = strip_end(text)
    tags = re.findall(TAG.format("answer"), text, flags=FLAGS)
    chosen = normalize_answer(tags[-1] if tags else text)
    if chosen and chosen in (same := [normalize_answer(a) for a in answers]):  # an empty text names no branch
        return same.index(chosen)
    scores = [f1_score(a, chosen) if chosen else 0.0 for a in answers]
    return scores.index(max(scores)) if max(scores) > 0 else next((k for k, d in enumerate(decisions) if d == STOP), 0)


PARSE = {  # what the rollout reads from each agent's output; `info` is what the request carried
    "rewrite": lambda text, info: parse_rewrites(text, info["width"], info["fallback"]),
    "select": lambda text, info: select_branch(text, info["answers"], info["decisions"]),
    "evaluate": lambda text, info: parse_decision(text),
    "answer": lambda text, info: clean_answer(text),
}
PARSE |= {role: lambda text, info: strip_end(text) for role in ("update", "merge")}  # the notes


# --------------------------------------------------------------------------- 3. rewards and pair rules [§3.4, §4.1]
def is_correct(answer, golds, by):
    """An answer's correctness label (ours: the paper names none): acc (a gold in the answer) or em."""
    return bool((exact_match if by == "em" else sub_exact_match)(answer, golds))


def paragraph_recall(retrieved_ids, gold_ids):
    """|retrieved ∩ gold| / |gold| [§4.1, §5.1]; None without gold paragraphs."""
    gold = set(map(str, gold_ids or []))
    return len(gold & set(map(str, retrieved_ids))) / len(gold) if gold else None


def jaccard_avg(sets):
    """Mean pairwise Jaccard overlap of retrieved sets [App. B.2]; None for fewer than two sets."""
    pairs = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1 :]]
    return sum(len(a & b) / max(len(a | b), 1) for a, b in pairs) / len(pairs) if pairs else None


def rewrite_pair(recalls):
    """(chosen, rejected): the first highest- over the first lowest-recall sample if higher [§3.4], else None."""
    hi = max(range(len(recalls)), key=lambda i: (recalls[i], -i))
    lo = min(range(len(recalls)), key=lambda i: (recalls[i], i))
    return (hi, lo) if recalls[hi] > recalls[lo] else None


def evaluator_pair(decisions, correct, lam, synthesize=False):
    """(chosen, rejected, weight): the first decision matching the answer's correctness (STOP if correct)
    over the first other one, weight lam for CONTINUE over a wrong STOP [§3.4]; missing: None (synthesize: -1)."""
    good = STOP if correct else CONTINUE
    chosen = next((i for i, d in enumerate(decisions) if d == good), -1 if synthesize else None)
    rejected = next((i for i, d in enumerate(decisions) if d != good), None)
    return None if chosen is None or rejected is None else (chosen, rejected, lam if good == CONTINUE else 1.0)


# --------------------------------------------------------------------------- 4. agents, retrievers, the trace
def policy_role(model, tokenizer, args, temperature, max_tokens=None, adapter="default"):
    """A role played by the backbone: one generate call (per gen_batch_size) for all requests; T 0 is greedy.
    `adapter`: the role's own where the model has one per role (role_adapters, header item 13)."""

    def chat(requests, seed=0):
        prompts = chat_prompts(tokenizer, [[{"role": "user", "content": r["prompt"]}] for r in requests])
        toy.use_role_adapter(model, adapter)
        model.eval()
        sampling = {"do_sample": temperature > 0, "temperature": temperature or 1.0, "stop": ["[END]"]}
        texts, n, size = [], max_tokens or args.max_new_tokens, args.gen_batch_size
        for s in range(0, len(prompts), size):  # simplification: one seed per generate call (header item 6)
            texts += generate(model, tokenizer, prompts[s : s + size], n, seed=seed + s, **sampling).texts
        return texts

    return chat


def llm_role(llm, args, temperature):
    """A role played by a frozen LLM (`--llm`: the toy reader, a local model or an endpoint)."""

    def chat(requests, seed=0):
        messages = [[{"role": "user", "content": r["prompt"]}] for r in requests]
        return llm.chat(messages, temperature=temperature, max_tokens=args.max_new_tokens, stop=["[END]"], seed=seed)

    return chat


def make_ctx(policy, tokenizer, retrievers, llm, args, trained=None):
    """The backbone of each role [§4.2, App. A.4], a token counter and the retrievers (`trained`: the teacher)."""
    other = (lambda t: policy_role(policy, tokenizer, args, t)) if llm is None else (lambda t: llm_role(llm, args, t))
    roles = {"rewrite": policy_role(policy, tokenizer, args, args.temperature)}
    roles |= {"evaluate": policy_role(policy, tokenizer, args, 0.0, args.evaluator_max_tokens, "evaluate")}
    roles |= trained or {}
    roles |= {role: other(args.temperature) for role in ("update", "answer", "select", "merge")}

    def count(prompts, outputs):  # simplification: every role in the backbone's tokenizer (header item 4)
        chats = chat_prompts(tokenizer, [[{"role": "user", "content": p}] for p in prompts])
        ins, outs = (tokenizer(list(texts), add_special_tokens=False)["input_ids"] for texts in (chats, outputs))
        return [len(i) for i in ins], [len(o) for o in outs]

    return {"roles": roles, "count": count, "retrievers": retrievers, "args": args, "tpl": TEMPLATES[args.templates]}


WH_WORDS = {"what", "where", "when", "who", "whom", "whose", "which", "why", "how"}  # [App. A.3]: "e.g." ours


def retrieve(retrievers, items, top_k, dense_only=False):
    """Top-k passages for each (strategy, query), one search call per strategy; BM25 drops wh-words [App. A.3]."""
    hits = [None] * len(items)
    for strategy in ("bm25", "dense"):
        picked = [i for i, (s, _) in enumerate(items) if ("dense" if dense_only else s) == strategy]
        queries = [items[i][1] for i in picked]
        if strategy == "bm25":
            queries = [" ".join(w for w in q.split() if w.lower() not in WH_WORDS) or q for q in queries]
        for i, found in zip(picked, retrievers[strategy].search(queries, top_k) if picked else []):
            hits[i] = found
    return hits


@dataclass
class Run:
    """One question's state in Algorithm 1: the global note m^(t) (m^(0) = "" [L1]), q_t (q0, then the last winner's
    sub-query: ours), its answer and STOP, this round's branches; evaluation's cost, trace, retrievals, snapshots."""

    row: dict
    note: str = ""
    query: str = ""
    answer: str = ""
    rounds: int = 0
    stopped: bool = False
    branches: list = field(default_factory=list)
    trace: list = field(default_factory=list)
    cost: Counter = field(default_factory=Counter)
    retrieved: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)


@dataclass
class Branch:
    """Branch k of a round [L5-10]: its strategy and sub-query q_k, its private note m'_k, answer a_k, decision e_k."""

    run: Run
    k: int
    strategy: str
    query: str
    note: str = ""
    answer: str = ""
    decision: str = ""


def req(run, prompt, k=None, **info):
    """A request to an agent: its question's run, the branch k, the prompt, and what the parser and trace keep."""
    return {"run": run, "k": k, "prompt": prompt, "info": info}


def call_role(ctx, role, t, requests, seed=0, parse=None):
    """One batched call of an agent for all requests: the outputs read by `parse` (default PARSE[role]). Every call is
    traced in its run (prompt, output, parse: the preference builder reads the traces) and costed (tokens, §4.1)."""
    if not requests:
        return []
    texts = ctx["roles"][role](requests, seed)
    n_in, n_out = ctx["count"]([r["prompt"] for r in requests], texts)
    parsed = [(parse or PARSE[role])(text, r["info"]) for r, text in zip(requests, texts)]
    for r, text, p, a, b in zip(requests, texts, parsed, n_in, n_out):
        r["run"].cost.update(llm_calls=1, tokens=a + b, generated_tokens=b)
        entry = {"t": t, "role": role, "k": r["k"], "prompt": r["prompt"], "output": text, "parsed": p}
        r["run"].trace.append(entry | r["info"])
    return parsed


# --------------------------------------------------------------------------- 5. Algorithm 1, batched [§3.3]
def sparc_rag(rows, ctx, width, depth, early_exit=True, seed=0):
    """Algorithm 1 for questions advancing together, one call per role per round for all live branches. One Run per
    row: answer, rounds, cost, the trace of every agent call, a snapshot per round (depth t of a fixed-depth run)."""
    played = [Run(row, query=row["question"]) for row in rows]  # m^(0) = "" [Alg. 1 L1]
    live = list(played)
    quiet = not PartialState().is_local_main_process or len(rows) < 50
    for t in runs.progress(range(1, depth + 1), "rounds", disable=quiet, leave=False):  # [L2]
        step_seed = seed + 10 * t
        distribute(ctx, live, width, t, step_seed)  # Phase 1 [L3-4]
        explore(ctx, [b for run in live for b in run.branches], t, step_seed)  # Phase 2 [L5-10]
        winners = select_best(ctx, live, t, step_seed)  # Phase 3 [L11-12]
        notes = merge_notes(ctx, live, winners, t, step_seed)  # [L13]
        for run, winner, note in zip(live, winners, notes):
            advance(run, winner, note, t)
        live = [run for run in live if not (early_exit and run.stopped)]  # exit on e_k* = STOP [L14-15]
        if not live:
            break
    return played  # a run still live at D_max returns its last winner's answer [§3.3]


def distribute(ctx, live, width, t, seed):
    """Phase 1 [Alg. 1 L3-4]: the Query Rewriter writes W (strategy, sub-query) items per question in one call
    [§3.2]; each item opens a branch (run.branches). q_t: the question in round 1, then the last winner's sub-query."""
    fill = lambda run: {"N": width, "query": run.row["question"], "current_query": run.query}
    prompts = [ctx["tpl"]["rewrite"].format(context=run.note, **fill(run)) for run in live]
    requests = [req(run, p, width=width, fallback=run.query) for run, p in zip(live, prompts)]
    for run, items in zip(live, call_role(ctx, "rewrite", t, requests, seed)):  # {q_k} <- RewriteQuery [L4]
        run.branches = [Branch(run, k, strategy, query) for k, (strategy, query) in enumerate(items)]


def explore(ctx, branches, t, seed):
    """Phase 2 [Alg. 1 L5-10]: every branch retrieves [L7], folds its passages into its own copy of the global note
    m^(t-1) [L8], answers q0 from that note [L9] and judges the answer [L10]; branches never see each other."""
    args, tpl = ctx["args"], ctx["tpl"]
    found = retrieve(ctx["retrievers"], [(b.strategy, b.query) for b in branches], args.top_k, args.dense_only)
    for b, hits in zip(branches, found):  # r_k <- Retrieve(q_k, C)
        b.run.cost["retrievals"] += 1
        b.run.retrieved.append((t, [h["id"] for h in hits]))
    ask = lambda role, b, **fields: req(b.run, tpl[role].format(query=b.run.row["question"], **fields), b.k, **fields)
    requests = [ask("update", b, note=b.run.note, new_context=format_passages(r)) for b, r in zip(branches, found)]
    for b, m in zip(branches, call_role(ctx, "update", t, requests, seed)):  # m'_k <- MemUpdate(m^(t-1), r_k)
        b.note = m
    for b, a in zip(branches, call_role(ctx, "answer", t, [ask("answer", b, note=b.note) for b in branches], seed)):
        b.answer = a  # a_k <- AnsGenerate(q0, m'_k)
    requests = [ask("evaluate", b, current_query=b.query, note=b.note, answer=b.answer) for b in branches]
    for b, e in zip(branches, call_role(ctx, "evaluate", t, requests, seed)):  # e_k <- EvaluateAns(a_k, m'_k)
        b.decision = e


def select_best(ctx, live, t, seed):
    """Phase 3 [Alg. 1 L12]: k* <- SelectBest({a_k, e_k, m'_k}), the Context Manager's Answer Selection call per
    question; the winning branch of each. One branch: it wins, no call."""
    many = [run for run in live if len(run.branches) > 1]  # simplification: one branch, no call (header item 5)
    requests = []
    for run in many:
        blocks = format_answer_blocks(run.branches)
        prompt = ctx["tpl"]["select"].format(question=run.row["question"], answer_blocks=blocks)
        answers, decisions = [b.answer for b in run.branches], [b.decision for b in run.branches]
        requests.append(req(run, prompt, answers=answers, decisions=decisions))
    picks = iter(call_role(ctx, "select", t, requests, seed))
    return [run.branches[next(picks) if len(run.branches) > 1 else 0] for run in live]


def merge_notes(ctx, live, winners, t, seed):
    """[Alg. 1 L13]: m^(t) <- ContextMerge(m'_k*, {m'_k}_k!=k*), the branch notes merged, the winner's first, in one
    call per question: the only write to the shared context. One branch: its note, no call (header item 5)."""
    requests = []
    for run, winner in [(run, w) for run, w in zip(live, winners) if len(run.branches) > 1]:
        notes = [winner.note] + [b.note for b in run.branches if b is not winner]
        prompt = ctx["tpl"]["merge"].format(question=run.row["question"], reasoning_list=format_notes(notes))
        requests.append(req(run, prompt))
    merged = iter(call_role(ctx, "merge", t, requests, seed))
    # simplification: one branch, its note is m^(t) (header item 5)
    return [next(merged) if len(run.branches) > 1 else w.note for run, w in zip(live, winners)]


def advance(run, winner, note, t):
    """[Alg. 1 L13-15]: copy on write, m^(t) replaces m^(t-1); the winner's answer a_k* and e_k* (STOP ends the run's
    loop); q_t+1 is the winner's sub-query (ours); a snapshot of the cost after round t."""
    run.note, run.query, run.answer, run.rounds = note, winner.query, winner.answer, t
    run.stopped = winner.decision == STOP
    run.snapshots.append({**run.cost, "answer": winner.answer, "n_retrieved": len(run.retrieved)})


# --------------------------------------------------------------------------- 6. preference pairs [§3.4]
def states_of(played, role):
    """(trace entry, run) of every call of a role in the runs, once per prompt."""
    return list({e["prompt"]: (e, run) for run in played for e in run.trace if e["role"] == role}.values())


def build_pairs(played, ctx, sample, args):
    """Pairs from the traces of the base model's runs [§3.4]: per logged Rewriter input, n sampled rewrite sets by
    the combined recall of their W retrievals; per logged Evaluator input, n decisions by the answer's correctness."""
    rewrites = [(e, r) for e, r in states_of(played, "rewrite") if r.row["metadata"].get("supporting_doc_ids")]
    evaluations = states_of(played, "evaluate")
    texts = sample([e["prompt"] for e, _ in rewrites + evaluations], args.n_samples)
    groups = [[parse_rewrites(t, e["width"]) for t in ts] for (e, _), ts in zip(rewrites, texts)]  # unparsed: []
    flat = [item for group in groups for items in group for item in items]
    found = iter(retrieve(ctx["retrievers"], flat, args.top_k, args.dense_only))
    pairs, pick = [], lambda ts, i, j: {"chosen": ts[i], "rejected": ts[j]}
    for (entry, run), group, ts in zip(rewrites, groups, texts):
        union = [[h["id"] for _ in items for h in next(found)] for items in group]  # R(y): the items' union
        recalls = [paragraph_recall(ids, run.row["metadata"]["supporting_doc_ids"]) for ids in union]
        if got := rewrite_pair(recalls):
            pairs.append({"role": "rewrite", "prompt": entry["prompt"], "weight": 1.0} | pick(ts, *got))
    for (entry, run), ts in zip(evaluations, texts[len(rewrites) :]):
        correct = is_correct(entry["answer"], run.row["golden_answers"], args.correct_by)
        if got := evaluator_pair([parse_decision(t) for t in ts], correct, args.lam, args.synthesize_missing):
            canonical = ts + [f"<decision>{STOP if correct else CONTINUE}</decision> [END]"]  # index -1
            pairs.append({"role": "evaluate", "prompt": entry["prompt"], "weight": got[2]} | pick(canonical, *got[:2]))
    return pairs


def sampler(model, tokenizer, args):
    """sample(prompts, n): n texts per prompt from the backbone at T 1.0 (ours: §3.4 gives none), in one call."""
    chat = policy_role(model, tokenizer, args, 1.0)

    def sample(prompts, n, seed=0):
        out = chat([{"prompt": prompt} for prompt in prompts for _ in range(n)], seed)
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    return sample


# --------------------------------------------------------------------------- 7. losses
def sequence_logps(model, ids, loss_mask, attention):
    """log pi(y | x): the sum of the response tokens' log-probs, (B,); the logits at position i score token i + 1."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # (B, T-1, V)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return (logp * loss_mask[:, 1:]).sum(-1)  # (B,)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, weights, beta, reference_free=False):
    """Weighted DPO: the batch mean (ours: not over the sum of w) of w * -log sigmoid(beta * margin), margin =
    log pi(y+) - log pi(y-) as printed, minus the reference's by default; and beta * margin (the reward margins)."""
    margin = pi_chosen - pi_rejected  # [§3.4, Eq. L_AE]
    if not reference_free:
        margin = margin - (ref_chosen - ref_rejected)  # simplification: a reference (header item 2)
    return (weights * F.softplus(-beta * margin)).mean(), beta * margin  # softplus(-x) = -log sigmoid(x)


def pair_loss(model, ids, mask, attention, weights, args, reference):
    """dpo_loss and the reward margins of chosen-then-rejected sequences, the reference under `reference()`."""
    with torch.no_grad(), reference():  # pi_ref
        ref = sequence_logps(model, ids, mask, attention).chunk(2)  # (B,) chosen, (B,) rejected
    pi = sequence_logps(model, ids, mask, attention).chunk(2)
    return dpo_loss(*pi, *ref, weights, args.beta, args.reference_free)


def encode(tokenizer, prompt, response):
    """(ids, loss_mask) as assembled: chat prompt (0), the response as stored through its first [END] (<think> kept),
    EOS (1); one without [END] (cut by the token cap; or ended by EOS: the text cannot tell) as written, no EOS."""
    prompt = chat_prompts(tokenizer, [[{"role": "user", "content": prompt}]])[0]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    end = END.search(response)
    text = response[: end.start()] + "[END]" if end else response
    target = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * bool(end)
    return prompt_ids + target, [0] * len(prompt_ids) + [1] * len(target)


def batch_tensors(tokenizer, texts, device):
    """(ids, loss_mask, attention) of (prompt, response) texts as `encode` assembles them, right-padded, (B, T)."""
    ids, masks = zip(*[encode(tokenizer, *x) for x in texts])
    tensors = right_pad(ids, tokenizer.pad_token_id), right_pad(masks, 0), right_pad([[1] * len(i) for i in ids], 0)
    return tuple(x.to(device) for x in tensors)


def pair_tensors(micro, tokenizer, device):
    """(ids, loss_mask, attention) of the chosen then the rejected sequences, and the weights (B,)."""
    tensors = batch_tensors(tokenizer, [(p["prompt"], p[y]) for y in ("chosen", "rejected") for p in micro], device)
    return *tensors, torch.tensor([p["weight"] for p in micro], device=device)


# ------------------------------------------------------------------------- 8. weighted DPO with LoRA [§3.4, App. A.4]
def tune(accelerator, model, tokenizer, pairs, args, world, out):
    """The tuned model and its DPO steps: one adapter on the combined pairs [§4.5], or one per trained role."""
    if args.role_adapters:  # simplification: per-role adapters, the rewriter's "default" (header item 13)
        return toy.tune_per_role(dpo_train, accelerator, model, tokenizer, pairs, args, world, out)
    return dpo_train(accelerator, model, tokenizer, pairs, args, world, out)


def dpo_train(accelerator, model, tokenizer, pairs, args, world, out, adapter="default", logged=0, epochs=None):
    """Weighted DPO of one LoRA adapter (q/k/v/o) on `pairs` [§4.5], against the adapter-disabled model; AdamW, linear
    decay, clipping 1.0 (ours: HF defaults); the same step for any process count and --micro_batch_size."""
    rng = random.Random(args.seed)
    longest = lambda p: max(len(encode(tokenizer, p["prompt"], p[y])[0]) for y in ("chosen", "rejected"))
    pairs = [p for p in pairs if longest(p) <= args.max_length]
    lora = {"r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout}
    if adapter == "default":
        model = add_lora(model, lora | {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    else:  # a second adapter (role_adapters, header item 13), the same configuration, trained alone
        toy.add_role_adapter(model, adapter)
    for p in model.parameters():  # never Adam on bf16 weights: the adapters train in fp32
        p.data = p.data.float() if p.requires_grad else p.data
    epochs = epochs or args.dpo_epochs
    steps = -(-epochs * len(pairs) // args.dpo_batch_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.dpo_lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(steps, 1))
    model, optimizer = accelerator.prepare(model, optimizer)
    order = [pairs[i] for _ in range(epochs) for i in rng.sample(range(len(pairs)), len(pairs))]
    reference = accelerator.unwrap_model(model).disable_adapter  # pi_ref: the adapter(s) disabled
    for step in range(steps):  # batches in order through the shuffled epochs, renamed whole on every process
        batch = order[step * args.dpo_batch_size : (step + 1) * args.dpo_batch_size]
        batch = [p | dict(zip(TEXTS, toy.renamed([p[k] for k in TEXTS], world, rng, args.augment_p))) for p in batch]
        mine, weight = runs.own_share(batch, accelerator)
        model.train()
        optimizer.zero_grad()
        stats = []

        def loss_of(rows):  # the micro-batch's share of the batch mean (DDP averages over the processes)
            ids, mask, attention, w = pair_tensors(mine[rows], tokenizer, accelerator.device)
            loss, rewards = pair_loss(model, ids, mask, attention, w, args, reference)
            stats.append((loss.item() * len(w), rewards.sum().item(), (rewards > 0).sum().item(), len(w)))
            return loss * len(w) * accelerator.num_processes * weight / len(batch)

        runs.micro_backward(accelerator, model, len(mine), args.micro_batch_size, loss_of)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        sums = torch.tensor([sum(c) * weight for c in zip(*stats)], dtype=torch.float64, device=accelerator.device)
        loss, margin, accuracy, n = accelerator.reduce(sums, "sum").tolist()  # over every process's pairs
        record = {"losses/dpo": loss / n, "rewards/margin": margin / n, "rewards/accuracy": accuracy / n}
        runs.log_update(accelerator, out, record | {"step": logged + step + 1}, logged + step + 1)
    return accelerator.unwrap_model(model), logged + steps


# --------------------------------------------------------------------------- 9. evaluation [§4.1, §5]
def run_record(run, args, upto=None):
    """A question's scores and cost at its end, or after round `upto` of a fixed-depth run."""
    snap = run.snapshots[upto - 1] if upto else {**run.cost, "answer": run.answer}
    rounds, answer, golds = upto or run.rounds, snap["answer"], run.row["golden_answers"]
    retrieved = [(t, set(map(str, ids))) for t, ids in run.retrieved if t <= rounds]
    judged = [(e["answer"], e["parsed"]) for e in run.trace if e["role"] == "evaluate" and e["t"] <= rounds]
    wrong = [d for a, d in judged if not is_correct(a, golds, args.correct_by)]
    # simplification: the B.2 overlap of each round's own retrievals, not a dense re-retrieval (header item 4)
    overlaps = [o for r in range(1, rounds + 1) if (o := jaccard_avg([s for t, s in retrieved if t == r])) is not None]
    gold = run.row["metadata"].get("supporting_doc_ids")
    record = answer_scores(answer, golds)
    record["recall"] = paragraph_recall(set().union(*[s for _, s in retrieved]), gold)
    record |= {k: snap.get(k, 0) for k in ("tokens", "generated_tokens", "llm_calls", "retrievals")}
    record |= {"rounds": rounds, "wrong_judged": len(wrong), "wrong_stops": wrong.count(STOP)}
    return record | {"overlap": sum(overlaps) / len(overlaps) if overlaps else None}


def summarize(records, rows):
    """Means (recall, overlap: where defined), incorrect acceptance (Fig. 7), avg [§4.1], by question type."""

    def mean(recs):
        out = {k: (sum(vs) / len(vs) if (vs := [r[k] for r in recs if r[k] is not None]) else None) for k in recs[0]}
        stops, judged = out.pop("wrong_stops") * len(recs), out.pop("wrong_judged") * len(recs)
        out["incorrect_acceptance"] = stops / judged if judged else None
        return out | {"n": len(recs), "avg": (out["acc"] + out["f1"] + out["em"]) / 3}

    groups = defaultdict(list)
    for rec, row in zip(records, rows):
        groups[str(row["metadata"].get("type"))].append(rec)
    keep = ("f1", "em", "rounds", "recall", "tokens", "n")
    return mean(records) | {"groups": {k: {m: v for m, v in mean(g).items() if m in keep} for k, g in groups.items()}}


@runs.evaluation
def evaluate(ctx, rows, width, depth, early_exit, predictions=None):
    """SPARC-RAG on the rows (split over the processes, gathered in order); `predictions`: a json line per question."""
    start, args = time.time(), ctx["args"]
    played = runs.map_shared(lambda part: sparc_rag(part, ctx, width, depth, early_exit, args.seed), rows)
    records = [run_record(run, args) for run in played]
    if predictions is not None and PartialState().is_main_process:
        write_jsonl(predictions, [prediction_of(run, rec) for run, rec in zip(played, records)])
    setting = {"width": width, "depth": depth, "early_exit": early_exit}
    return summarize(records, rows) | {"setting": setting, "latency_s": (time.time() - start) / max(len(rows), 1)}


def prediction_of(run, record):
    """One line of predictions_<stage>.jsonl: golds, prediction, the rounds in short, scores and cost."""
    show = lambda e: " | ".join(" ".join(i) for i in e["parsed"]) if e["role"] == "rewrite" else str(e["parsed"])
    steps = [f"t{e['t']} {e['role']}: {show(e)}" for e in run.trace if e["role"] in ("rewrite", "evaluate")]
    row, short = run.row, {"prediction": run.answer, "trajectory": " ; ".join(steps)}
    return {"id": row.get("id"), "question": row["question"], "golden_answers": row["golden_answers"]} | short | record


def brief(result):
    """One log line of an evaluation."""
    return " ".join(f"{k}={result[k]:.3f}" for k in (*TABLE, "overlap") if result.get(k) is not None)


# --------------------------------------------------------------------------- 10. train / eval / ask
def frozen_parts(args):
    """The BM25 and dense retrievers [App. A.3], and the frozen LLM of the untrained roles (None: the backbone)."""
    dense = open_retriever(args.dense_index, args.corpus, args.encoder)
    bm25 = dense if args.dense_only else open_retriever(args.bm25_index, args.corpus, "bm25")
    served = {"model": args.llm_model} if args.llm_model else {}
    llm = None if args.llm == "policy" else make_llm(args.llm, world=args.world, **served)
    return {"dense": dense, "bm25": bm25}, llm


def load_policy(args, device, model_name=None):
    """The backbone and tokenizer (a checkpoint's per-role adapters with it: role_adapters, header item 13)."""
    # fp32 master weights; without a warm-up only LoRA trains, so a GPU run keeps the frozen base in bf16
    dtype = torch.bfloat16 if device.type == "cuda" and args.sft_steps == 0 else torch.float32
    model, tokenizer = load_model_and_tokenizer(model_name or args.model, dtype=dtype, world=args.world)
    if args.format_tokens:  # simplification: single-token tags for a model trained from scratch (header item 10)
        toy.add_format_tokens(model, tokenizer)
    toy.load_role_adapters(model, model_name or args.model)
    return model.to(device), tokenizer


def result_record(args, results, steps, wall, pairs=None):
    """runs.result_record, tokens and pairs per question; `before` is the untuned system at fixed depth [§4.5]."""
    final = results.get("after") or results["before"]
    record = runs.result_record("sparcrag", args, results.get("before_sft"), results["before"], final, steps, wall)
    return record | results | {"after": final, "tokens_per_question": final["tokens"], "pairs": pairs}


def saved_state(args, **state):
    """A checkpoint's run_state.json: its method, data, toy world (--world) and arguments, and `state`."""
    return {"method": "sparcrag", "data_dir": args.data_dir, "world": args.world, "args": asdict(args)} | state


def train(args):
    """Warm-up, the untuned system's evaluations, pairs from its runs, weighted DPO, the tuned evaluation."""
    start, (accelerator, out) = time.time(), runs.start(args, "sparcrag", stages=("sft", "dpo"))
    train_rows = sample_rows(load_split(args.data_dir, "train"), args.n_train, args.seed)
    test_rows = load_split(args.data_dir, "test")[: args.n_eval]
    (retrievers, llm), results, warnings = frozen_parts(args), {}, []
    world = toy.renaming_world(args)  # simplification: toy renaming (header item 9)
    # simplification: the toy's untuned start, a warm-up on a teacher (header item 8); the paper's: the model as it is
    this, parts = sys.modules[__name__], (retrievers, llm)  # this file's rollout and evaluation; its frozen parts
    policy, tokenizer, n_sft = toy.warm_up(this, accelerator, args, out, train_rows, test_rows, parts, world, results)
    policy.name_or_path = str((out / "sft").resolve()) if args.sft_steps else args.model  # the LoRA base
    ctx = make_ctx(policy, tokenizer, retrievers, llm, args)
    with accelerator.autocast():  # the untuned system: fixed depth [§4.5]; and with its own stop decisions (ours)
        fixed = out / "predictions_untuned.jsonl"
        results["before"] = evaluate(ctx, test_rows, args.width, args.untuned_depth, False, fixed)
        results["before_adaptive"] = evaluate(ctx, test_rows, args.width, args.depth, True)
    accelerator.print("\n".join(f"untuned, {k} | {brief(results[k])}" for k in ("before", "before_adaptive")))
    curve = lambda rows: evaluate(ctx, rows, args.width, args.depth, True)  # the tuned system's inference [§4.5]
    if (state := runs.load_state(out / "dpo")) is not None:  # resume: tuned
        policy, tokenizer = load_policy(args, accelerator.device, str(out / "dpo"))
    else:
        runs.curve_point(accelerator, out, args, 0, curve)  # the curve's start: the untuned (warm-up) model
        with accelerator.autocast():  # the base model's own runs on training questions [§3.4]
            mine = train_rows[accelerator.process_index :: accelerator.num_processes]
            own = sparc_rag(mine, ctx, args.width, args.untuned_depth, early_exit=False, seed=args.seed)
            pairs = build_pairs(own, ctx, sampler(policy, tokenizer, args), args)
            pairs = [p for ps in gather_object([pairs]) for p in ps]
        counts = dict(Counter(p["role"] for p in pairs) + Counter(f"weight_{p['weight']:g}" for p in pairs))
        accelerator.print(f"pairs: {counts} from {len(train_rows)} training questions")
        for role in [r for r in TRAINED if r not in counts] if args.role_adapters else ["any role's"] * (not pairs):
            # every sampled rewrite set tied (or no gold paragraphs to score them), every sampled decision agreed
            runs.nothing_to_train(accelerator, warnings, "dpo", f"0 {role} preference pairs")
        policy, steps = tune(accelerator, policy, tokenizer, pairs, args, world, out)
        state = saved_state(args, pairs=counts, steps=steps, warnings=warnings)
        if accelerator.is_main_process:
            runs.save_checkpoint(out / "dpo", policy, tokenizer, state)
    with accelerator.autocast():  # the tuned system: adaptive depth, capped at D_max [§4.5]
        ctx = make_ctx(policy, tokenizer, retrievers, llm, args)
        results["after"] = evaluate(ctx, test_rows, args.width, args.depth, True, out / "predictions_dpo.jsonl")
    runs.curve_point(accelerator, out, args, state["steps"], curve)  # one offline DPO stage [§3.4]: its end
    evaluations = {"stage": "eval"} | {k: results[k] for k in ("before", "before_adaptive", "after")}
    runs.append_metrics(out / "metrics.jsonl", evaluations, accelerator.is_main_process)
    accelerator.end_training()
    results["warnings"] = state.get("warnings", [])  # the stages that trained on nothing (runs.nothing_to_train)
    record = result_record(args, results, {"sft": n_sft, "dpo": state["steps"]}, time.time() - start, state["pairs"])
    runs.write_results(out, record, accelerator.is_main_process, TABLE)


def run_eval(args):
    """Evaluate --model (--width, --depth, --early_exit) on the test split."""
    start, (accelerator, out) = time.time(), runs.start_eval(args)
    accelerator.print(f"evaluation folder: {out}")
    rows = load_split(args.data_dir, "test")[: args.n_eval]  # a bad data file fails first
    policy, tokenizer = load_policy(args, accelerator.device)
    ctx = make_ctx(policy, tokenizer, *frozen_parts(args), args)
    with accelerator.autocast():
        result = evaluate(ctx, rows, args.width, args.depth, args.early_exit, out / "predictions_eval.jsonl")
    accelerator.print(f"eval {result['setting']} | {brief(result)}")
    record = result_record(args, {"before": result, "warnings": []}, {"sft": 0, "dpo": 0}, time.time() - start)
    runs.write_results(out, record, accelerator.is_main_process, TABLE)


def ask(args):
    """One question through Algorithm 1 with --model, printing every agent call."""
    policy, tokenizer = load_policy(args, runs.make_accelerator().device)
    if unknown := unknown_words(tokenizer, args.ask):
        print(f"warning: words the model's tokenizer does not know (read as <unk>): {' '.join(unknown)}")
    ctx = make_ctx(policy, tokenizer, *frozen_parts(args), args)
    row = {"id": "ask", "question": args.ask, "golden_answers": [""], "metadata": {}}
    run = sparc_rag([row], ctx, args.width, args.depth, args.early_exit, args.seed)[0]
    for e in run.trace:
        who = e["role"] + ("" if e["k"] is None else str(e["k"] + 1))
        print(f"round {e['t']} {who}: {' '.join(str(e['parsed']).split())}")
    print(f"answer: {run.answer} (rounds: {run.rounds})")


def main(argv=None):
    """Parse the flags, fill the preset, dispatch on the mode."""
    untrained = "the raw toy-lm writes no valid rewrite (the tuned model: runs/<run_name>/dpo)"
    args = apply_preset(runs.parse_args(Args, argv, untrained, "sparcrag", PRESETS))
    (runs.dry_run if args.dry_run else train if args.train else run_eval if args.eval else ask)(args)


if __name__ == "__main__":
    runs.run_main(main)
