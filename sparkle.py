# SPARKLE: A Structured and Plug-and-play Agentic Retrieval Policy for Adaptive RAG Models
# ACL 2026; the text read is the anonymous ACL submission (no arXiv id; tags cite its sections). Docs: docs/sparkle.md
"""SPARKLE: a small proxy LM plays three agents around a frozen LLM's step-wise reasoning; binary-tree rollout, PPO.

After each `<think>` step of the frozen LLM, one proxy plays Retrieval Decision (Yes/No), Query Formulation (a KG
chain of `<head; relation; tail>` triples with `[unknown]` gaps, then a query) and Knowledge Integration (one triple;
its source document joins the LLM's context) [§2.2, Alg. 1]. Training [§3, App. C]: SFT on a teacher's successful
trajectories, then PPO on a binary tree rollout (both RD answers for the first L steps, Eq. 1, pruned), each operation
credited with the mean reward of its leaves (Eq. 2), R = α·Recall(c_T) + (1−α)·F1(y). Compare c3po.py.

    python sparkle.py --train --run_name sparkle                # toy world, tiny proxy, CPU: warm-up, SFT, PPO, eval
    python sparkle.py --ask "what is the birthplace of the director of zekil ?" --model runs/sparkle/ppo
    accelerate launch sparkle.py --train --preset paper --data_dir DATA --index DIR --llm http://HOST/v1 --llm_model M

Departures from the paper, both presets (each marked `# simplification: ... (header N)` where it lives):
1. An LLM teacher (--teacher_model) plays the proxy zero-shot with the agents' prompts (the paper's are unstated).
2. The thoughts so far go to the LLM as an assistant message (impl: the assistant turn continued raw).
3. PPO trains QF's and KI's sampled tokens, not the authors' canonical re-renders (RD's: the exact Yes/No, impl).
4. The critic is a proxy backbone (critic_init; impl: the base proxy) with a zero-initialised scalar head.
5. Advantages are whitened over the rollout, one PPO epoch, value clipping 0.2 (the authors' OpenRLHF settings).
6. The ablations' prompts are ours (the paper describes them; App. D.2); w/o QF keeps the QF output format.
7. The LLM's steps are capped at llm_max_tokens (impl: 256); latency is batched wall time per question.
8. The context keeps at most max_context documents (impl: 5; the paper: no cap), the best new ones, oldest out.
9. A proxy prompt over --max_length minus --max_new_tokens tokens is cut in the middle (Tab. 5-6: 2048, no rule).

Toy-world adaptations, the toy preset only (numbered on; preset-only fields, the machinery in common/toy/sparkle.py):
10. The warm-up teacher is an oracle (teacher_model oracle) reading the question's metadata, wrong at teacher_noise.
11. The warm-up keeps the cheapest successes (warmup_select) of one- and two-hop questions (warmup_types).
12. SFT examples are entity-renamed for the proxy (augment_p; not-popular PPO trees with rl_augment_p, 0).
13. toy-lm proxy, toy reader, compact templates, top-3 documents, 5 triples, L = 2, PPO minibatches of 32.
14. PPO: forced RD answers' loss x forced_weight 0.1, the code's credit shaping (code_shaping), critic_init sft.
"""

import copy
import math
import random
import re
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

from common import runs
from common.data import DataError, load_split, read_jsonl, require_metadata, sample_rows, write_jsonl
from common.llm import backbone_of, chat_prompts, generate, right_pad, unknown_words
from common.metrics import answer_scores, doc_recall, f1_score, summarize
from common.models import is_toy_lm, load_model_and_tokenizer, make_llm
from common.retrieval import TfidfEncoder, load_corpus, open_retriever
from common.runs import arg, cosine
from common.toy import sparkle as toy

ABLATIONS = ["none", "no_rd", "no_qf", "direct_qf", "no_ki", "direct_ki"]
TABLE = ("em", "f1", "acc", "reward", "recall", "retrievals", "steps", "llm_calls", "generated_tokens", "latency_s")


@dataclass
class Args:
    preset: str = arg("toy", "toy (toy world, tiny proxy, CPU) or paper", choices=["toy", "paper"], group="run")
    train: bool = arg(False, "teacher warm-up data, SFT, PPO, evaluation")
    eval: bool = arg(False, "evaluate --model (a checkpoint or the untrained start)")
    ask: str = arg("", "answer one question with --model and print the trajectory")
    extract_triples: bool = arg(False, "write the KG corpus --triples of --corpus with --llm (real corpora) [§D.3]")
    output_dir: str | None = arg(None, "results, metrics, checkpoints (default: runs/<run_name>, <model>/eval/...)")
    run_name: str | None = arg(None, "a training run's name (default: sparkle__<seed>__<time>)")
    resume: bool = arg(False, "continue the run --run_name / --output_dir from its last checkpoint")
    dry_run: bool = arg(False, "print the resolved configuration, check its paths and models, load nothing")
    report_to: str = arg("none", "tracker beside metrics.jsonl", choices=["none", "tensorboard", "wandb"])
    seed: int = arg(0, "seed of models, sampling and data order")
    eval_every: int | None = arg(None, "checkpoint and learning-curve point every this many PPO updates", low=1)
    data_dir: str | None = arg(None, "folder with train/test jsonl (FlashRAG QA)", group="data and models")
    world: str | None = arg(None, runs.WORLD_HELP)
    corpus: str | None = arg(None, "FlashRAG corpus jsonl (default: data_dir/corpus.jsonl)")
    triples: str | None = arg(None, "KG corpus jsonl {doc_id, head, relation, tail} (default: data_dir/triples.jsonl)")
    index: str = arg("", "saved retriever folder (python -m common.retrieval build) [§4.1: E5, wiki-18]")
    encoder: str | None = arg(None, "tfidf, bm25 or a dense encoder (hub id or folder) when --index is empty")
    model: str | None = arg(None, "proxy: hub id, folder or toy-lm spec [§4.1: Qwen2.5-3B-Instruct]")
    llm: str | None = arg(None, "frozen LLM: toy, hf:<name>, http(s)://.../v1 [§4.1: Qwen2.5-7B-Instruct]")
    llm_model: str = arg("", "served model name when --llm is an endpoint URL")
    reasoning_llm: bool = arg(False, "a reasoning LLM: Fig. 7's prompt, steps split at blank lines, \\boxed{} answers")
    n_train: int | None = arg(None, "training questions (None: all) [§D.3: 7,500]", low=1)
    n_eval: int | None = arg(None, "test questions evaluated (None: all) [§4.1: 1,000]", low=1)
    question_types: str = arg("", "comma-separated metadata types to keep (empty: all)")
    top_k: int | None = arg(None, "documents per retrieval [§D.3: 10]", low=1, group="agents and rollout [§2.2, §3.1]")
    n_triples: int | None = arg(None, "candidate triples for KI [§D.3: 20] (impl: 25)", low=1)
    tree_depth: int | None = arg(None, "L: steps with both RD branches [§3.1, §D.3: 4]", low=0)
    standard_rollout: bool = arg(False, "the w/ Standard Rollout ablation: RD sampled from the first step [Tab. 4]")
    ablation: str = arg("none", "w/o RD, QF; w/ Direct QF; w/o KI; w/ Direct KI [Tab. 4]", choices=ABLATIONS)
    alpha: float = arg(0.3, "R = alpha Recall(c_T) + (1 - alpha) F1(y) [§3.2, §D.3: 0.3] (impl: 0.7)", low=0, high=1)
    max_new_tokens: int | None = arg(None, "proxy tokens per action (impl: 160 in training)", low=1)
    max_length: int = arg(2048, "prompt + action tokens, a longer prompt cut [Tab. 5, 6: 2048] (header 9)", low=2)
    teacher_model: str | None = arg(None, "oracle or an LLM as --llm (empty: --llm) [§D.3]", group="warm-up [Tab. 5]")
    teacher_llm_model: str = arg("", "served model name when --teacher_model is an endpoint URL")
    sft_steps: int | None = arg(None, "SFT steps (0: one epoch of the warm-up data [Tab. 5])", low=0)
    sft_lr: float | None = arg(None, "SFT learning rate [Tab. 5: 5e-6]", low=0)
    sft_batch_size: int | None = arg(None, "SFT batch size [Tab. 5: 64]", low=1)
    micro_batch_size: int | None = arg(None, "sequences per forward pass, SFT and PPO (gradient accumulation)", low=1)
    ppo_iterations: int | None = arg(None, "PPO updates [App. E.1: ~60 to converge]", low=0, group="PPO [§3, Tab. 6]")
    rollout_batch: int | None = arg(None, "questions (trees) per PPO update, over all processes (impl: 64)", low=1)
    ppo_batch_size: int | None = arg(None, "operation samples per minibatch, over all processes [Tab. 6: 1024]", low=1)
    policy_lr: float | None = arg(None, "policy learning rate [Tab. 6: 5e-7]", low=0)
    value_lr: float | None = arg(None, "value model learning rate [Tab. 6: 5e-6]", low=0)
    kl_coef: float = arg(0.002, "KL coefficient beta, a per-token penalty in the reward [Tab. 6: 0.002]", low=0)
    # ---- set by the presets only (no flags): the authors' code's constants, the toy world's tuning (PRESETS)
    max_context: int = arg(5, "documents in the context, oldest out (impl: 5; header 8)", flag=False)
    max_steps: int = arg(12, "LLM reasoning steps in training (impl: 12)", flag=False)
    max_steps_eval: int = arg(20, "LLM reasoning steps at test (impl: 20)", flag=False)
    max_retrievals: int = arg(5, "retrievals per trajectory (impl: 5)", flag=False)
    max_rd_calls: int = arg(8, "RD calls per trajectory in training (impl: 8; at test: the step cap)", flag=False)
    llm_max_tokens: int = arg(256, "LLM tokens per step (impl: 256; header 7)", flag=False)
    gen_batch_size: int = arg(512, "prompts per proxy generate call (memory only: 512)", flag=False)
    templates: str | None = arg(None, "the App. A figures (paper), or compact ones (header 13)", flag=False)
    teacher_temperature: float = arg(0.6, "LLM teacher sampling temperature (ours: 0.6)", flag=False)
    teacher_noise: float = arg(0.2, "the toy oracle's probability of a wrong decision (header 10)", flag=False)
    warmup_keep: int = arg(4, "teacher trajectories per question, the successful ones kept (ours: 4)", flag=False)
    warmup_select: str | None = arg(None, "uniform: every success [§D.3]; cheapest (header 11)", flag=False)
    warmup_types: str | None = arg(None, "question types of the warm-up data, comma-separated (header 11)", flag=False)
    augment_p: float | None = arg(None, "entity-renaming probability of an SFT example (header 12)", flag=False)
    rl_augment_p: float = arg(0.0, "renaming probability of a not-popular PPO tree (0: off; header 12)", flag=False)
    gamma: float = arg(1.0, "GAE gamma within an operation (impl: 1)", flag=False)
    lam: float = arg(0.95, "GAE lambda (impl: 0.95)", flag=False)
    clip: float = arg(0.2, "PPO clip epsilon (impl: 0.2)", flag=False)
    vf_coef: float = arg(0.5, "value loss coefficient (impl: 0.5)", flag=False)
    value_clip: float = arg(0.2, "value clip around the old values, 0: none (impl: 0.2; header 5)", flag=False)
    max_grad_norm: float = arg(1.0, "gradient clipping (impl: 1.0)", flag=False)
    critic_init: str | None = arg(None, "the critic's backbone: base (impl) or sft (header 14)", flag=False)
    code_shaping: bool | None = arg(None, "Eq. 2 credits shaped as in the authors' code (impl; header 14)", flag=False)
    forced_weight: float | None = arg(None, "policy-loss weight of Eq. 1's forced RD answers (header 14)", flag=False)


PRESETS = {  # field: (toy, paper), for the fields left at None; a flag overrides them
    "data_dir": ("data/toy", "data/sparkle"),
    "encoder": ("tfidf", "intfloat/e5-large-v2"),  # [§D.3]
    "model": ("toy-lm", "Qwen/Qwen2.5-3B-Instruct"),  # [§4.1]
    "llm": ("toy", "hf:Qwen/Qwen2.5-7B-Instruct"),  # [§4.1]
    "top_k": (3, 10),  # [§D.3]
    "n_triples": (5, 20),  # [§D.3]
    "tree_depth": (2, 4),  # [§D.3]
    "max_new_tokens": (48, 160),  # impl
    "teacher_model": ("oracle", "hf:Qwen/Qwen2.5-72B-Instruct"),  # [§D.3]; toy: the oracle teacher (header 10)
    "sft_steps": (1500, 0),  # [Tab. 5] one epoch; toy: a fixed step count
    "sft_lr": (2e-3, 5e-6),  # [Tab. 5]
    "sft_batch_size": (32, 64),  # [Tab. 5]
    "micro_batch_size": (8, 4),  # impl
    "ppo_iterations": (10, 120),  # impl: one episode of 7,500 questions, 64 per rollout
    "rollout_batch": (64, 64),  # impl: 64
    "eval_every": (2, 10),  # a learning-curve point and a checkpoint every 2 of the toy's 10 updates
    "ppo_batch_size": (32, 1024),  # [Tab. 6]
    "policy_lr": (1e-4, 5e-7),  # [Tab. 6]
    "value_lr": (1e-3, 5e-6),  # [Tab. 6]
    # preset-only fields
    "templates": ("compact", "paper"),  # toy: no instruction prose for the tiny proxy (header 13)
    "warmup_select": ("cheapest", "uniform"),  # toy: the cheapest successes, a clearer signal (header 11)
    "warmup_types": ("one_hop,two_hop", ""),  # toy: the types the oracle teacher solves cleanly (header 11)
    "augment_p": (1.0, 0.0),  # toy: renamed SFT examples, copied from the context, not memorised (header 12)
    "critic_init": ("sft", "base"),  # toy: a critic from the SFT proxy learns faster (header 14)
    "code_shaping": (True, False),  # toy: the authors' code's credit shaping (header 14)
    "forced_weight": (0.1, 1.0),  # toy: forced answers down-weighted (header 14)
}


def apply_preset(args):
    """Fill the fields left at None from the preset's column; the toy world of a toy model or reader (--world)."""
    for key, values in PRESETS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[args.preset == "paper"])
    args.corpus = args.corpus or str(Path(args.data_dir) / "corpus.jsonl")
    args.triples = args.triples or str(Path(args.data_dir) / "triples.jsonl")
    args.world = args.world or runs.toy_world(None, args.data_dir)  # the preset's --data_dir may hold one
    toys = [f"--{k} {v}" for k, v in (("model", args.model), ("llm", args.llm)) if v == "toy" or is_toy_lm(v)]
    if toys and not args.world and not args.extract_triples:
        raise SystemExit(f"{' and '.join(toys)}: no toy world in --data_dir {args.data_dir}; pass --world DIR")
    if args.output_dir is None and args.eval:  # a folder of its own, never over a training run or an evaluation
        args.output_dir = runs.eval_dir(args, "sparkle")
    return args


# --------------------------------------------------------------------------- 1. prompts [App. A; impl strings]
# The paper set: Fig. 4-8 as printed, the instruction as the system message and the inputs as the user message (impl);
# the authors' code strings add lines to each. The compact set keeps the fields and output formats without the prose
# (header 13).
PAPER_TEMPLATES = {
    # [App. A.4, Fig. 6] the LLM: one <think> step per call, {context} re-rendered every step
    "llm": """\
Instruction:
Please answer the following question. You should think step-by-step to solve it. You should first output all your \
internal thinking steps. Each thought should be put inside <think> and </think> tags. After reasoning, you must put \
your final answer inside <answer> and </answer> without detailed instructions.

Your output should look like:

<think> [put your first thought here] </think>

<think> [put your second thought here] </think>

...

<think> [put your final thought here] </think>

<answer> [put your final answer (short phrase or keyword only) here] </answer>

Inputs:

Context: {context}

Question: {question}""",
    # [App. A.1, Fig. 4] Retrieval Decision: the instruction (the paper elides its criteria, "..."; impl:
    # DETERMINE_RETRIEVAL_INSTRUCTION_WITH_CONTEXT lists them) and the inputs
    "rd_system": """\
You are an intelligent assistant. Your job is to decide whether external information retrieval is required to \
continue solving the problem.

You will be given the following inputs:

- Question: The original user query.
- Previous Reasoning: A list of prior reasoning thoughts the model has generated.
- Current Reasoning Step: The latest reasoning step to evaluate.
- Retrieved Context: Text previously retrieved that may contain relevant information.

Your task is to answer whether the **current reasoning step** requires external retrieval...

Output Format
ONLY output "Yes (retrieval is required)" or "No (retrieval is not required)" and do not include any other text.""",
    "rd": """\
Retrieved Context: {context}
Question: {question}
Previous Reasoning: {history}
Current Reasoning Step: {current}""",
    # [App. A.2, Fig. 5] Query Formulation (impl adds "If no additional information is needed, set the query to None.")
    "qf_system": """\
You are an intelligent reasoning assistant. Your task is to help bridge the information gap between a current \
reasoning trace (thought) and the full answer to a given question by generating a high-quality retrieval query.

You will follow these three steps:

[Step 1: Generate Reasoning Chain]
Given the question and the corresponding thought, extract the information that is directly helpful for answering the \
question. Represent each piece of information as a structured knowledge triple in the format <head; relation; tail>. \
Output Format: <head1; relation1; tail1>, <head2; relation2; tail2>, ... <headN; relationN; tailN>

[Step 2: Identify Knowledge Gaps]
Based on the extracted reasoning chain, identify the **next piece of information** that is required to continue \
reasoning toward the answer to the question. This could be a missing fact, relation, or intermediate concept that, \
if known, would allow the reasoning to proceed.
Output Format: To continue answering the question, we need to know: [describe the next necessary piece of information]

[Step 3: Formulate Retrieval Query]
Write a concise and effective natural language query that can help retrieve the specific information identified in \
Step 2. The query should be focused, contain the key entities and relations, and be suitable for a retrieval \
system.""",
    "qf": """\
Question: {question}
Thoughts: {thoughts}""",
    # [App. A.3, Fig. 8] Knowledge Integration
    "ki_system": """\
You are an intelligent reasoning assistant. Your task is to select the most useful knowledge triple from a list of \
candidates to help continue a reasoning process toward answering a given question.

You will be given:

- A question
- A current reasoning chain represented as a sequence of knowledge triples
- A query, which may reflect an information need to guide the next reasoning step
- A set of candidate triples

Your goal: Select only one triple that is most useful for continuing the reasoning toward answering the question. \
This selected triple should logically extend the current reasoning chain and help bridge the gap toward the final \
answer.""",
    "ki": """\
Candidate Triples: {candidates}

Question: {question}

Reasoning Chain: {chain}

Query: {query}""",
    # [App. A.4, Fig. 7] a reasoning LLM (--reasoning_llm): its steps split at blank lines (impl), a \boxed{} answer
    "llm_boxed": """\
Instruction:
Please answer the following question. You should think step-by-step to solve it. Provide your final answer in the \
format \\boxed{{YOUR_ANSWER}}.

Inputs:

Context: {context}

Question: {question}""",
    # the ablations' prompts [App. D.2]; simplification: ours, after the paper's description (header 6)
    "llm_search": "{llm}\n\nWhen a thought needs external information, write <search> inside it.",
    "rd_qf_system": "{rd_system}\n\nIf retrieval is required, continue after it with the three steps:\n\n{qf_system}",
    "qf_direct_system": "Given a question and the reasoning thoughts so far, formulate an appropriate retrieval query "
    "for the next piece of information needed. Only output the query, or None if nothing is needed.",
    "qf_direct": "Question: {question}\n\nThoughts:\n{thoughts}\n\nQuery:",
    "ki_direct_system": "Select the document that is most useful for continuing the reasoning toward answering the "
    "question. Only output the index of the selected document.",
    "ki_direct": "Documents:\n{candidates}\n\nQuestion: {question}\n\nQuery:\n{query}\n\nSelected Document:",
    # output formats [Fig. 4; Tab. 8: the QF output as the trained proxy writes it] and renderings (impl)
    "rd_yes": "Yes (retrieval is required)",
    "rd_no": "No (retrieval is not required)",
    "qf_output": "Step 1: Reasoning Chain: {chain}\nStep 2: Knowledge Gaps: To continue answering the question, we "
    "need to know: {gap}\nStep 3: Retrieval Query: **{query}**",
    "document": "Title: {title}\nText: {text}",
    "documents": "\n\n",
    "candidate": "{i}. Source Title: {title}\nText: {text}",
    "candidates": "\n",
}
PAPER_TEMPLATES = {k: v.format(**PAPER_TEMPLATES) if "_system" in k or k == "llm_search" else v
                   for k, v in PAPER_TEMPLATES.items()} | {"rd_qf": PAPER_TEMPLATES["rd"]}  # fmt: skip
# impl (prompts/): the triple extraction prompt of the KG corpus, run once offline [§4.1, §D.3]
EXTRACTION_PROMPT = """\
You are a knowledge graph constructor tasked with extracting knowledge triples in the form of <head entity; \
relation; tail entity> from a document. Each triple denotes a specific relationship between entities or an event. \
The head entity and tail entity can be the provided title or phrases in the text. If multiple tail entities share \
the same relation with a head entity, aggregate these tail entities using commas. Format your output in the form of \
<head entity; relation; tail entity>."""

TEMPLATES = {"paper": PAPER_TEMPLATES, "compact": toy.COMPACT_TEMPLATES}  # simplification: compact (header 13)
AGENTS = ("rd", "qf", "ki")  # [§2.1] I = {Retrieval Decision, Query Formulation, Knowledge Integration}


def format_documents(tpl, docs):
    """The context c_t as the LLM and the RD agent read it: `Title: {title}\\nText: {text}` (impl)."""
    return tpl["documents"].join(tpl["document"].format(title=d["title"], text=d["text"]) for d in docs)


def format_candidates(tpl, candidates):
    """KI's numbered candidates, `{i}. Source Title: {title}\\nText: {triple}` (impl; a document for w/ Direct KI)."""
    lines = [tpl["candidate"].format(i=i, title=h["title"], text=text) for i, (h, text) in enumerate(candidates, 1)]
    return tpl["candidates"].join(lines)


def thought_text(thoughts):
    """LLM output -> the agents' view of it: tags dropped, steps joined by blank lines (impl)."""
    text = "\n\n".join(s for s in (x.replace("<think>", "").strip() for x in thoughts.split("</think>")) if s)
    return text + "\n\n" if text else ""


def llm_messages(tpl, args, question, docs, thoughts):
    """[Fig. 6; Fig. 7] The user message, {context} re-rendered from c_t; the thoughts so far as the assistant's."""
    key = "llm_search" if args.ablation == "no_rd" else "llm_boxed" if args.reasoning_llm else "llm"
    user = tpl[key].format(context=format_documents(tpl, docs), question=question)
    # simplification: the thoughts so far as an assistant message, not a raw continuation (header 2)
    thoughts = [{"role": "assistant", "content": thoughts.strip()}] if thoughts else []
    return [{"role": "user", "content": user}] + thoughts


# --------------------------------------------------------------------------- 2. parsing [§2.2; impl rules]
def unthought(text):
    """An output without its `<think>` blocks (an unclosed one to the end) and markdown emphasis: what parsers read."""
    return re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.S).replace("**", "")


def parse_rd(text):
    """Retrieval? `"yes" in response.lower()` (impl), the thinking aside."""
    return "yes" in unthought(text).lower()


# a QF step header as the paper shows one: Tab. 8's `Step 1: Reasoning Chain:`, Fig. 5's `[Step 1: Generate Reasoning
# Chain]`, markdown's `### Step 1: Reasoning Chain`; the compact set's `step 1 : chain :`
QF_STEP = re.compile(r"\bstep\s*([123])\s*[:.]?(?:[a-z ]*?\b(?:chain|gaps?|query)\b)?\s*[:\]]?", re.I)


def parse_qf(text, question, direct=False):
    """(chain g_t, query q_t): Step 1's text, Step 3's first line (impl: `None`; no Step 3: question + output)."""
    text = unthought(text)
    if direct:  # w/ Direct QF: the whole output is the query
        chain, query = "", text.strip()
    else:  # the first of each step
        heads = list(QF_STEP.finditer(text))
        ends = [h.start() for h in heads[1:]] + [len(text)]
        steps = dict(reversed([(h[1], text[h.end() : e].strip().strip("[#:]").strip()) for h, e in zip(heads, ends)]))
        chain = steps.get("1", "")
        query = steps["3"].split("\n")[0].strip() if "3" in steps else f"Question: {question}\n{text}"
    return chain, None if query.lower().rstrip(" .") in ("none", "") else query


def parse_ki(text, candidates, direct=False):
    """The selected candidate: the first `<...>` span's best token-F1 match (impl); w/ Direct KI, a 1-based index."""
    text = unthought(text)
    if direct:
        number = re.search(r"\d+", text)
        return int(number.group()) - 1 if number and 1 <= int(number.group()) <= len(candidates) else None
    span = (re.findall(r"<([^>]+)>", text) or [text])[0]
    scores = [f1_score(span, [c]) for _, c in candidates]
    return max(range(len(candidates)), key=scores.__getitem__) if candidates and max(scores) > 0 else None


def extract_answer(text):
    """y [Alg. 1 L16]: the last `\\boxed{}` (Fig. 7), else the first `<answer>` span, or what follows it (impl)."""
    if boxed := re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", text):
        return re.sub(r"\\text\{([^{}]*)\}", r"\1", boxed[-1]).strip()
    if spans := [s.strip() for s in re.findall(r"<answer>(.*?)</answer>", text, re.S) if s.strip()]:
        return spans[0]
    return re.sub(r"</?(think|answer)>", " ", text.split("<answer>", 1)[-1]).strip()


# --------------------------------------------------------------------------- 3. reward and credit [§3.2, Eq. 2]
def leaf_reward(recall, f1, alpha):
    """R = alpha * Recall(c_T) + (1 - alpha) * F1(y) [§3.2] (the authors' code weights Recall by 0.7: alpha 0.7)."""
    return alpha * recall + (1 - alpha) * f1


def context_recall(doc_ids, row):
    """Recall(c_T): the share of the gold supporting documents in the context; 0 without gold documents (impl)."""
    gold = (row.get("metadata") or {}).get("supporting_doc_ids") or []
    return doc_recall(doc_ids, gold) if gold else 0.0


def leaf_credits(nodes):
    """Eq. 2 for every node: the mean reward of the leaves it reaches (not of child means); None without a leaf."""
    total, count = [0.0] * len(nodes), [0] * len(nodes)
    for i in reversed(range(len(nodes))):
        if nodes[i]["kind"] == "leaf":
            total[i], count[i] = total[i] + nodes[i]["reward"], count[i] + 1
        if (parent := nodes[i]["parent"]) is not None:
            total[parent], count[parent] = total[parent] + total[i], count[parent] + count[i]
    return [t / c if c else None for t, c in zip(total, count)]


# --------------------------------------------------------------------------- 4. rollout [§3.1, Eq. 1, Alg. 1]
class KGRetriever:
    """The retriever with the KG corpus G: hits carry their triples [Alg. 1 L11]; the encoder that ranks them."""

    def __init__(self, retriever, triples):
        self.retriever, self.triples = retriever, triples
        fitted = lambda: TfidfEncoder().fit([t for ts in triples.values() for t in ts] or ["none"])  # BM25: TF-IDF
        self.encoder = getattr(retriever, "encoder", None) or fitted()

    def search(self, queries, k):
        hits = self.retriever.search(queries, k)
        return [[dict(h, triples=self.triples.get(str(h["id"]), [])) for h in found] for found in hits]


def load_triples(path):
    """doc id -> ["<head; relation; tail>", ...] from a jsonl of {doc_id, head, relation, tail} (§D.3: offline)."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no KG corpus (triples); write one with python sparkle.py --extract_triples")
    triples = defaultdict(list)
    for row in read_jsonl(path, required=("doc_id", "head", "relation", "tail")):
        triples[str(row["doc_id"])].append(f"<{row['head']}; {row['relation']}; {row['tail']}>")  # [§2.2]
    return triples


def rank_triples(encoder, questions, queries, found, n):
    """K_t: the retrieved documents' triples ranked by similarity to question + query (impl), top n [§D.3]."""
    pairs = [[(hit, t) for hit in hits for t in hit.get("triples", [])] for hits in found]
    texts = [t for ps in pairs for _, t in ps]
    if not texts:
        return [[] for _ in pairs]
    q = encoder.encode([f"{a} {b}" for a, b in zip(questions, queries)], is_query=True)  # (P, D)
    scores = iter(encoder.encode(texts) @ q.T)  # (N, P)
    sims = [[float(next(scores)[i]) for _ in ps] for i, ps in enumerate(pairs)]  # each pair: its question's column
    return [[ps[j] for j in sorted(range(len(ps)), key=lambda j: -s[j])[:n]] for ps, s in zip(pairs, sims)]


def add_documents(docs, new, cap):
    """c_{t+1} = c_t + the best `cap` new documents in rank order, none twice, oldest out past `cap` (header 8)."""
    ids = {d["id"] for d in docs}
    return (docs + [d for d in new[:cap] if d["id"] not in ids and not ids.add(d["id"])])[-cap:]


@dataclass
class Trajectory:
    """One trajectory of a tree in progress [Alg. 1]: its place in the tree and the state s^t its agents read."""

    tree: dict  # row, nodes (dicts, a parent before its children), llm_calls, proxy_calls
    node: int = 0  # its last node: the parent of its next one
    docs: list = field(default_factory=list)  # the context c_t
    thoughts: str = ""  # r_<=t, each step followed by its separator
    previous: str = ""  # r_<t
    current: str = ""  # r_t
    step: int = 0  # t: LLM steps taken
    retrievals: int = 0
    rd_calls: int = 0
    trace: list = field(default_factory=list)  # per step: (context doc ids, retrievals so far) [Fig. 3]
    branch: int = 0  # the node of its last Yes: marked pruned if the retrieval leaves c_t unchanged [§3.1]
    chain: str = ""  # g_t [Alg. 1 L9]
    query: str | None = None  # q_t


@dataclass
class Request:
    """A pending agent state s_i^t [§2.2]: the proxy (or the teacher) writes one output, or Eq. 1 forces `fixed`."""

    path: Trajectory | None
    agent: str  # rd, qf or ki
    prompt: tuple  # (system, user)
    prefix: str = ""  # w/o QF: the forced Yes that the RD agent's chain and query continue
    fixed: str | None = None  # Eq. 1's forced RD answer
    cands: list | None = None  # KI's candidates [(hit, triple or document text)]


@dataclass
class Rollout:
    """What the steps of one rollout share: the actor, the environment, the flags and templates, L, caps, seed."""

    act: object  # act(requests, seed) -> [(text, prompt_ids, action_ids)]
    env: object  # chat(messages, rows, ...) and search(queries, k, rows)
    args: Args
    tpl: dict
    depth: int  # L: the steps whose RD answers are both expanded [§3.1]
    max_steps: int
    max_rd: int
    seed: int


def add_node(tree, parent, kind, depth, **fields):
    """Append a node to a tree; returns its index (children always come after their parent)."""
    tree["nodes"].append(dict(kind=kind, parent=parent, depth=depth, **fields))
    return len(tree["nodes"]) - 1


def add_leaf(path, reply, why, alpha):
    """A complete trajectory below its last node: its answer y, final context c_T, per-step trace, reward R [§3.2]."""
    trace, answer = path.trace + [([d["id"] for d in path.docs], path.retrievals)], extract_answer(reply)
    recall, f1 = context_recall(trace[-1][0], path.tree["row"]), f1_score(answer, path.tree["row"]["golden_answers"])
    fields = dict(answer=answer, why=why, docs=trace[-1][0], trace=trace, recall=recall, f1=f1)
    add_node(path.tree, path.node, "leaf", path.step, **fields, reward=leaf_reward(recall, f1, alpha))


def agent_outputs(run, requests, step, salt):
    """One proxy call for an agent's pending states [§2.2], each output a node below its path: [(request, text)]."""
    outputs = run.act(requests, run.seed + 1000 * step + salt) if requests else []
    for r, (text, prompt_ids, action_ids) in zip(requests, outputs):
        r.path.tree["proxy_calls"] += r.fixed is None
        node = add_node(r.path.tree, r.path.node, r.agent, step, text=text, prompt=r.prompt, prompt_ids=prompt_ids,
                        action_ids=action_ids, fixed=r.fixed)  # fmt: skip
        r.path = replace(r.path, node=node)
    return [(r, text) for r, (text, _, _) in zip(requests, outputs)]


def think(run, paths, step):
    """[Alg. 1 L4-6] r_t = LLM(q, c_t) for every live path, one call, {context} re-rendered; an answer ends a path
    in a leaf, as does the step cap (impl: one non-stepwise answer). Returns (paths RD judges, paths past a cap)."""
    args, tpl = run.args, run.tpl
    # a step ends at </think> [App. A.4]; a reasoning LLM's at a blank line (impl), the steps kept apart by one
    end, sep = ("\n\n", "\n\n") if args.reasoning_llm else ("</think>", "\n")
    messages = [llm_messages(tpl, args, p.tree["row"]["question"], p.docs, p.thoughts) for p in paths]
    replies = run.env.chat(messages, [p.tree["row"] for p in paths], temperature=0.0, max_tokens=args.llm_max_tokens,
                           stop=[end])  # fmt: skip  # simplification: capped steps (header 7)
    deciding, capped, ended = [], [], []
    for path, reply in zip(paths, replies):
        path.tree["llm_calls"] += 1
        cut = "<think>" in reply and "</think>" not in reply and not args.reasoning_llm  # its stop string dropped
        reply = reply.strip() + " </think>" * cut
        node = add_node(path.tree, path.node, "llm", step, text=reply)
        path = replace(path, node=node, thoughts=path.thoughts + reply + sep, previous=path.thoughts, current=reply,
                       step=path.step + 1)  # fmt: skip
        if ("\\boxed{" if args.reasoning_llm else "<answer>") in reply:  # [Alg. 1 L5-6] the answer ends it
            add_leaf(path, reply, "answer", args.alpha)
        elif path.step >= run.max_steps:
            ended.append(path)
        else:  # impl caps on retrievals and RD calls: the path reasons on without a decision
            past = path.retrievals >= args.max_retrievals or path.rd_calls >= run.max_rd
            (capped if past else deciding).append(path)
    # impl: no answer within the step cap: one non-stepwise generation with the final context
    messages = [llm_messages(tpl, args, p.tree["row"]["question"], p.docs, "") for p in ended]
    replies = run.env.chat(messages, [p.tree["row"] for p in ended], temperature=0.0, stop=[],
                           max_tokens=args.llm_max_tokens * run.max_steps)  # fmt: skip
    for path, reply in zip(ended, replies):
        path.tree["llm_calls"] += 1
        add_leaf(path, reply, "max_steps", args.alpha)
    return deciding, capped


def rd_requests(tpl, path, ablation, both):
    """RD's state s_1^t = (q, c_t, r_<=t) [§2.2]; both: [Eq. 1] its two answers forced (w/o QF: Yes a prefix)."""
    key = "rd_qf" if ablation == "no_qf" else "rd"
    user = tpl[key].format(context=format_documents(tpl, path.docs), question=path.tree["row"]["question"],
                           history=thought_text(path.previous), current=thought_text(path.current))  # fmt: skip
    request = Request(path, "rd", (tpl.get(key + "_system", ""), user))
    yes = replace(request, prefix=tpl["rd_yes"]) if ablation == "no_qf" else replace(request, fixed=tpl["rd_yes"])
    return [yes, replace(request, fixed=tpl["rd_no"])] if both else [request]


def decide(run, paths, step):
    """[Alg. 1 L7-8] retrieval = RD(q, c_t, r_<=t); in the first L steps of a tree rollout [Eq. 1] both answers, each
    a branch; w/o RD [App. D.2] the LLM's <search> decides. Returns (retrieving paths, the others: c_{t+1} = c_t)."""
    if run.args.ablation == "no_rd":
        yes = [replace(p, branch=p.node) for p in paths if "<search>" in p.current]
        return yes, [p for p in paths if "<search>" not in p.current]
    yes, no = [], []
    requests = [r for p in paths for r in rd_requests(run.tpl, p, run.args.ablation, step < run.depth)]
    for r, text in agent_outputs(run, requests, step, 0):
        (yes if parse_rd(text) else no).append(replace(r.path, rd_calls=r.path.rd_calls + 1, branch=r.path.node))
    return yes, no


def formulate(run, paths, step):
    """[Alg. 1 L9] g_t, q_t = QF(q, r_<=t) for every retrieving path (w/o QF [App. D.2]: the RD agent wrote them)."""
    ablation, tpl = run.args.ablation, run.tpl
    if ablation == "no_qf":
        outputs = [(Request(p, "rd", ()), p.tree["nodes"][p.node]["text"]) for p in paths]
    else:
        key = "qf_direct" if ablation == "direct_qf" else "qf"
        user = lambda p: tpl[key].format(question=p.tree["row"]["question"], thoughts=thought_text(p.thoughts))
        requests = [Request(p, "qf", (tpl.get(key + "_system", ""), user(p))) for p in paths]
        outputs = agent_outputs(run, requests, step, 1)
    parsed = [(r.path, parse_qf(text, r.path.tree["row"]["question"], ablation == "direct_qf")) for r, text in outputs]
    return [replace(path, chain=chain, query=query) for path, (chain, query) in parsed]


def integrate(run, paths, step):
    """[Alg. 1 L10-12] D_t = Retriever(q_t); K_t = G(D_t), ranked; c_{t+1} = KI(q, g_t, K_t) (w/o KI: every hit; w/
    Direct KI: a document [App. D.2]). Returns [(path, c_{t+1})], c_t kept without a query or candidates."""
    args, tpl = run.args, run.tpl
    updates = [(p, p.docs) for p in paths if p.query is None]  # no query: no retrieval
    paths = [replace(p, retrievals=p.retrievals + 1) for p in paths if p.query]
    found = run.env.search([p.query for p in paths], args.top_k, [p.tree["row"] for p in paths])
    if args.ablation == "no_ki":
        return updates + [(p, add_documents(p.docs, hits, args.max_context)) for p, hits in zip(paths, found)]
    direct, key = args.ablation == "direct_ki", "ki_direct" if args.ablation == "direct_ki" else "ki"
    questions = [p.tree["row"]["question"] for p in paths]
    if direct:  # w/ Direct KI: the documents
        ranked = [[(h, h["text"]) for h in hits] for hits in found]
    else:
        ranked = rank_triples(run.env.retriever.encoder, questions, [p.query for p in paths], found, args.n_triples)
    requests = []
    for path, question, cands in zip(paths, questions, ranked):
        user = tpl[key].format(candidates=format_candidates(tpl, cands), question=question, chain=path.chain,
                               query=path.query)  # fmt: skip
        if cands:
            requests.append(Request(path, "ki", (tpl.get(key + "_system", ""), user), cands=cands))
        else:
            updates.append((path, path.docs))
    for r, text in agent_outputs(run, requests, step, 2):
        chosen = [r.cands[i][0]] if (i := parse_ki(text, r.cands, direct)) is not None else []  # footnote 3
        updates.append((r.path, add_documents(r.path.docs, chosen, args.max_context)))
    return updates


def prune(run, updates, step):
    """[§3.1, Fig. 11] c_{t+1} for every path; in the first L steps a retrieval branch that leaves c_t unchanged is
    pruned: its Yes node marked, no leaf below it (its operations get no credit). Returns the paths that go on."""
    kept = []
    for path, docs in updates:
        if step < run.depth and [d["id"] for d in docs] == [d["id"] for d in path.docs]:
            path.tree["nodes"][path.branch]["pruned"] = True
        else:
            kept.append(replace(path, docs=docs))
    return kept


def reasoning_step(run, paths, step):
    """One step t of Alg. 1 (L4-15) for the live paths of every tree, an agent's calls batched: the paths of t + 1."""
    deciding, going = think(run, paths, step)  # L4-6
    retrieving, not_retrieving = decide(run, deciding, step)  # L7-8 [Eq. 1]
    going += not_retrieving  # L13-14: c_{t+1} = c_t
    going += prune(run, integrate(run, formulate(run, retrieving, step), step), step)  # L9-12 [§3.1]
    return [replace(p, trace=p.trace + [([d["id"] for d in p.docs], p.retrievals)]) for p in going]  # L15


def rollout(rows, act, env, args, mode, seed=0):
    """Trajectories of Alg. 1 for rows, batched across their trees a step at a time; mode: tree (Eq. 1 for the first
    L steps [§3.1]), standard (RD sampled throughout: the warm-up, w/ Standard Rollout [Tab. 4]), greedy or sample."""
    testing = mode in ("greedy", "sample")
    run = Rollout(act, env, args, TEMPLATES[args.templates], seed=seed,
                  depth=args.tree_depth if mode == "tree" and args.ablation != "no_rd" else 0,  # w/o RD: no tree
                  max_steps=args.max_steps_eval if testing else args.max_steps,  # impl
                  max_rd=args.max_steps_eval if testing else args.max_rd_calls)  # fmt: skip
    trees = [dict(row=r, nodes=[dict(kind="root", parent=None, depth=0)], llm_calls=0, proxy_calls=0) for r in rows]
    paths, step = [Trajectory(tree) for tree in trees], 0
    while paths:
        paths, step = reasoning_step(run, paths, step), step + 1
    return trees


# --------------------------------------------------------------------------- 5. the proxy and the teacher as actors
def encode_prompts(tokenizer, prompts, room=None):
    """Agent prompts as single-turn chats (impl: system = instruction), over `room` tokens cut mid-way (header 9)."""
    chats = [([{"role": "system", "content": s}] if s else []) + [{"role": "user", "content": u}] for s, u in prompts]
    ids = tokenizer(chat_prompts(tokenizer, chats), add_special_tokens=False)["input_ids"]
    return [p if not room or len(p) <= room else p[: room // 2] + p[len(p) - room + room // 2 :] for p in ids]


def proxy_actor(model, tokenizer, args, greedy):
    """act(requests, seed) -> per request (text, prompt_ids, action_ids): one generate call (per gen_batch_size)."""

    def act(requests, seed):
        prompts = encode_prompts(tokenizer, [r.prompt for r in requests], args.max_length - args.max_new_tokens)
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        # a forced RD answer [Eq. 1]: tokenised with its EOS, and trained like a sampled one
        out = [(r.fixed, p, encode(r.fixed) + [tokenizer.eos_token_id]) if r.fixed is not None else None
               for r, p in zip(requests, prompts)]  # fmt: skip
        owners = [(i, encode(r.prefix)) for i, r in enumerate(requests) if r.fixed is None]  # w/o QF: a prefix
        batch = [prompts[i] + prefix for i, prefix in owners]
        model.eval()
        for s in range(0, len(batch), args.gen_batch_size):
            chunk = batch[s : s + args.gen_batch_size]  # T = 1 in training (impl), greedy at test [App. C]
            gen = generate(model, tokenizer, chunk, args.max_new_tokens, do_sample=not greedy, seed=seed + s)
            # simplification: QF and KI train their sampled ids, not a canonical re-render (header 3; RD: op_samples)
            for (i, prefix), ids in zip(owners[s : s + args.gen_batch_size], gen.token_ids):
                out[i] = (tokenizer.decode(prefix + ids, skip_special_tokens=True), prompts[i], prefix + ids)
        return out

    return act


def teacher_actor(args, llm, seed):
    """The warm-up teacher playing the proxy in standard rollouts [§D.3]: the toy oracle, or an LLM (zero-shot)."""
    tpl = TEMPLATES[args.templates]

    def act(requests, draw):  # draw: the seed of this call's sampling
        if args.teacher_model == "oracle":  # simplification: the toy oracle, in the template set's formats (header 10)
            return [(toy.oracle_text(r, tpl, args.ablation, seed, args.teacher_noise), None, None) for r in requests]
        system = lambda r: [{"role": "system", "content": r.prompt[0]}] if r.prompt[0] else []
        messages = [system(r) + [{"role": "user", "content": r.prompt[1]}] for r in requests]  # header 1
        replies = llm.chat(messages, temperature=args.teacher_temperature, max_tokens=args.llm_max_tokens, seed=draw)
        return [(text.strip(), None, None) for text in replies]

    return act


# --------------------------------------------------------------------------- 6. warm-up [§D.3: successful paths]
def successful_paths(trees, select="uniform"):
    """SFT pairs of a question's successful (F1 = 1) teacher trajectories [§D.3], its own outputs, none forced."""
    path = lambda nodes, i: [nodes[i]] + path(nodes, nodes[i]["parent"]) if i is not None else []  # leaf to root
    wins = [path(t["nodes"], i) for t in trees for i, n in enumerate(t["nodes"])
            if n["kind"] == "leaf" and n["why"] == "answer" and n["f1"] == 1]  # fmt: skip
    kept = [n for p in (wins if select == "uniform" else toy.cheapest(wins)) for n in p]  # cheapest: header 11
    pairs = {(tuple(n["prompt"]), n["text"]): n["kind"] for n in kept if n["kind"] in AGENTS and n["fixed"] is None}
    return [dict(prompt=p, output=o, agent=a) for (p, o), a in pairs.items()]


def build_warmup(rows, llm, env, args, batch=128):
    """SFT examples of --warmup_keep teacher trajectories a question [§D.3], split over the processes and gathered."""

    def per_question(part):
        got, keep, quiet = [], args.warmup_keep, not PartialState().is_local_main_process
        for s in runs.progress(range(0, len(part), batch), "warm-up", disable=quiet, leave=False):
            rows_s = [dict(r, sample=k) for r in part[s : s + batch] for k in range(keep)]
            trees = rollout(rows_s, teacher_actor(args, llm, args.seed), env, args, "standard", args.seed + s)
            got += [successful_paths(trees[i : i + keep], args.warmup_select) for i in range(0, len(trees), keep)]
        return got

    got = runs.map_shared(per_question, rows)
    return [e for g in got for e in g], sum(map(bool, got)) / max(len(rows), 1)


def sft_batch(examples, tokenizer, args, world):
    """(ids, labels, attention) by length: prompt + output + EOS in --max_length, loss on the output; toy renaming."""
    seqs = []
    for ex, seed in examples:  # (example, the seed of its renaming)
        texts = toy.renamed_texts([*ex["prompt"], ex["output"]], world, seed, args.augment_p)  # header 12
        prompt = encode_prompts(tokenizer, [texts[:2]], args.max_length - args.max_new_tokens)[0]
        target = tokenizer(texts[2], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(((prompt + target)[: args.max_length], ([-100] * len(prompt) + target)[: args.max_length]))
    seqs.sort(key=lambda s: len(s[0]))  # micro-batches of similar lengths: less padding, the same gradient
    ids, labels = right_pad([s[0] for s in seqs], tokenizer.pad_token_id), right_pad([s[1] for s in seqs], -100)
    return ids, labels, right_pad([[1] * len(s[0]) for s in seqs], 0)


def sft(accelerator, model, tokenizer, examples, args, world, out):
    """Cross-entropy on the warm-up pairs' outputs (runs.sft_step, own shares); Adam (0.9, 0.95), warm-up, cosine."""
    rng = random.Random(args.seed)  # the order, the same on every process
    steps = args.sft_steps or math.ceil(len(examples) / args.sft_batch_size)  # [Tab. 5] one epoch
    optimizer = torch.optim.Adam(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.95))  # impl: OpenRLHF
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine(s, steps, max(1, int(0.03 * steps))))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    order, losses = [], []
    for step in range(steps):
        if len(order) < args.sft_batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = order[: args.sft_batch_size], order[args.sft_batch_size :]
        own, weight = runs.own_share(batch, accelerator)  # an example's renaming: seeded by the step and itself
        tensors = sft_batch([(examples[i], f"{args.seed} {step} {i}") for i in own], tokenizer, args, world)
        losses.append(runs.sft_step(accelerator, model, optimizer, scheduler, *tensors, args.micro_batch_size,
                                    args.max_grad_norm, weight))  # fmt: skip
        if (step + 1) % 100 == 0 or step + 1 in (1, steps):  # the first step's loss, then the last 100 steps' mean
            stats = {"sft/loss": sum(losses[-100:]) / len(losses[-100:]), "sft/step": step + 1}
            runs.log_update(accelerator, out, stats, step=step + 1)
    return accelerator.unwrap_model(model), steps


# --------------------------------------------------------------------------- 7. PPO [§3, App. C; impl: OpenRLHF]
class ValueModel(torch.nn.Module):
    """The critic: a proxy backbone (no LM head) and a scalar head, a value per token (impl)."""

    def __init__(self, model):
        super().__init__()
        self.backbone = backbone_of(copy.deepcopy(model))
        self.head = torch.nn.Linear(model.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.head.weight)  # simplification: zero-initialised head (header 4)

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)  # (B, T)


def op_samples(trees, canonical=None, shaping=False):
    """One PPO sample per operation, pooled [App. C]: loss_mask = 1 on the action; canonical: RD as its Yes/No ids."""
    samples = []
    for tree in trees:
        credits = leaf_credits(tree["nodes"])  # [Eq. 2]
        credits = toy.code_shaping(tree["nodes"], credits, parse_rd) if shaping else credits  # header 14
        for n, credit in zip(tree["nodes"], credits):
            if n["kind"] in AGENTS and n["action_ids"] and credit is not None:
                action = canonical[parse_rd(n["text"])] if canonical and n["kind"] == "rd" else n["action_ids"]
                mask, ids = [0] * len(n["prompt_ids"]) + [1] * len(action), n["prompt_ids"] + action
                samples.append(dict(ids=ids, credit=credit, agent=n["kind"], loss_mask=mask, forced=bool(n["fixed"])))
    return samples


def gae(rewards, values, gamma, lam):
    """GAE within one operation's action tokens, V after the last token = 0: (A, G = A + V) (impl)."""
    advantages, last, next_values = [0.0] * len(rewards), 0.0, list(values[1:]) + [0.0]
    for m in reversed(range(len(rewards))):
        advantages[m] = last = rewards[m] + gamma * next_values[m] - values[m] + gamma * lam * last
    return advantages, [a + v for a, v in zip(advantages, values)]


def token_rewards(credit, logp_old, logp_ref, beta, clip=10.0):
    """-beta (log pi_old - log pi_ref) per token [Tab. 6], the Eq. 2 value clipped to +-clip on the last (impl)."""
    rewards = [-beta * (o - r) for o, r in zip(logp_old, logp_ref)]
    rewards[-1] += max(-clip, min(clip, credit))
    return rewards


def clipped_surrogate(new_logp, old_logp, advantages, mask, clip, weights=1.0):
    """Per operation, the masked mean over its action tokens of -min(r A, clip(r, 1-eps, 1+eps) A) * weight, and r."""
    ratio = torch.exp(new_logp - old_logp)  # (B, T)
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -(surrogate * mask * weights).sum(-1) / mask.sum(-1).clamp(min=1), ratio  # (B,)


def value_loss(values, old_values, returns, mask, clip):
    """Per operation, the masked mean of (V - G)^2; clip > 0: of max((V - G)^2, (V_old + clip(V - V_old) - G)^2)."""
    loss = (values - returns) ** 2  # (B, T)
    if clip > 0:  # simplification: OpenRLHF's value clipping (header 5)
        loss = torch.max(loss, (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2)
    return (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


def token_logp(model, ids, attention):
    """log pi(token t+1 | tokens <= t), (B, T-1): the per-token gather, shifted with the labels."""
    logits = model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def batch_tensors(samples, pad, device):
    """ids (B, T), attention (B, T) and the loss mask shifted with the labels (B, T-1)."""
    ids = right_pad([s["ids"] for s in samples], pad).to(device)
    attention = right_pad([[1] * len(s["ids"]) for s in samples], 0).to(device)
    return ids, attention, right_pad([s["loss_mask"] for s in samples], 0).to(device)[:, 1:].float()


@torch.no_grad()
def score_samples(policy, ref, value, samples, pad, device, args):
    """Old and reference log-probs and values, then per-token rewards and GAE per operation, into the samples."""
    by_length = sorted(samples, key=lambda s: len(s["ids"]))  # micro-batches of similar lengths: less padding
    for s in range(0, len(samples), args.micro_batch_size):
        chunk = by_length[s : s + args.micro_batch_size]
        ids, attention, mask = batch_tensors(chunk, pad, device)
        old, reference = token_logp(policy, ids, attention), token_logp(ref, ids, attention)
        values = value(ids, attention)[:, :-1].float()  # V(s_m): the state before action token m
        for row, sample in enumerate(chunk):
            cols = mask[row].nonzero().squeeze(-1)
            sample["old"], sample["ref"], sample["val"] = (x[row, cols].tolist() for x in (old, reference, values))
            rewards = token_rewards(sample["credit"], sample["old"], sample["ref"], args.kl_coef)
            sample["adv"], sample["ret"] = gae(rewards, sample["val"], args.gamma, args.lam)


def ppo_update(accelerator, policy, value, ref, optimizers, schedulers, samples, pad, args):
    """Score this process's samples, gather all, whiten, then minibatches over all agents' operations (own shares)."""
    device = accelerator.device
    policy.eval()
    score_samples(accelerator.unwrap_model(policy), ref, accelerator.unwrap_model(value), samples, pad, device, args)
    samples = gather_object(samples)  # every process's, in process order: the same minibatches on every process
    if not samples:  # no operation was credited: nothing to learn from
        return {}
    # simplification: advantages whitened over the rollout, population variance (header 5)
    ids, attention, mask = batch_tensors(samples, pad, device)  # pad once: (N, T), (N, T), (N, T-1)
    on_mask = lambda values: torch.zeros_like(mask).masked_scatter(mask.bool(), torch.tensor(values, device=device))
    old, old_values, returns, adv = (on_mask([x for s in samples for x in s[k]]) for k in ("old", "val", "ret", "adv"))
    advantages = (adv - adv[mask.bool()].mean()) / (adv[mask.bool()].std(correction=0) + 1e-8) * mask
    lengths = [len(s["ids"]) for s in samples]
    weights = torch.tensor([[args.forced_weight if s["forced"] else 1.0] for s in samples], device=device)  # (N, 1)
    policy.train()
    sums, rng = defaultdict(float), random.Random(args.seed + len(samples))  # sums: this process's, over the update
    n_mb = max(1, math.ceil(len(samples) / args.ppo_batch_size))

    def loss_of(rows, scale, weight, critic=False):  # some rows of a minibatch: their clipped surrogate, or value loss
        r, t = torch.tensor(rows, device=device), slice(0, max(lengths[i] for i in rows) - 1)  # cut to its longest
        x, att, msk = ids[r, : t.stop + 1], attention[r, : t.stop + 1], mask[r, t]  # (B, T), (B, T), (B, T-1)
        if critic:  # a separate network: its own backward
            vf = value_loss(value(x, att)[:, :-1].float(), old_values[r, t], returns[r, t], msk, args.value_clip)
            sums["value"] += vf.sum().item() * weight
            return args.vf_coef * vf.sum() * scale
        logp = token_logp(policy, x, att)  # (B, T-1)
        pg, ratio = clipped_surrogate(logp, old[r, t], advantages[r, t], msk, args.clip, weights[r])
        log_ratio = (logp - old[r, t]).detach()
        clipped, k3 = ((ratio - 1).abs() > args.clip).float(), (log_ratio.exp() - 1) - log_ratio
        for key, term in dict(policy=pg, clipped=clipped * msk, k3=k3 * msk, tokens=msk).items():
            sums[key] += term.sum().item() * weight
        return pg.sum() * scale  # all agents' operations, a mean over them

    order = rng.sample(range(len(samples)), len(samples))  # one epoch over the rollout (impl)
    for b in range(n_mb):
        mb = sorted(order[b::n_mb], key=lengths.__getitem__)  # length-sorted micro-batches: less padding
        own, weight = runs.own_share(mb, accelerator)  # a process without a row: a stand-in of weight 0
        scale = weight * accelerator.num_processes / len(mb)  # DDP averages over the processes
        for opt in optimizers:
            opt.zero_grad()
        for model, critic in ((policy, False), (value, True)):  # one all-reduce each (runs.micro_backward)
            part = lambda rows: loss_of(own[rows], scale, weight, critic)
            runs.micro_backward(accelerator, model, len(own), args.micro_batch_size, part)
        for model, opt in zip((policy, value), optimizers):
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
    for sched in schedulers:  # one scheduler step per PPO update (per rollout)
        sched.step()
    keys = ("policy", "value", "clipped", "k3", "tokens")  # summed over the processes: each sample once
    total = dict(zip(keys, runs.global_sum(accelerator, torch.tensor([sums[k] for k in keys])).tolist()))
    out = {f"losses/{k}": total[k] / len(samples) for k in ("policy", "value")}
    out |= {"losses/clipfrac": total["clipped"] / total["tokens"], "losses/approx_kl": total["k3"] / total["tokens"]}
    kl = [o - r for s in samples for o, r in zip(s["old"], s["ref"])]
    ret, val = returns[mask.bool()].cpu(), old_values[mask.bool()].cpu()
    explained = (1 - (ret - val).var() / ret.var().clamp(min=1e-8)).item() if len(ret) > 1 else 0.0
    return out | {"rollout/kl": sum(kl) / max(len(kl), 1), "losses/explained_variance": explained}


# --------------------------------------------------------------------------- 8. evaluation [§4.1, §4.2 RQ5-6]
def tree_record(tree):
    """Outcome of a one-path (inference) tree: EM, F1, acc, reward, recall of c_T, calls, tokens, steps."""
    leaf, golds = next(n for n in tree["nodes"] if n["kind"] == "leaf"), tree["row"]["golden_answers"]
    tokens = sum(len(n["action_ids"] or []) for n in tree["nodes"] if n["kind"] in AGENTS and n["fixed"] is None)
    record = dict(**answer_scores(leaf["answer"], golds), reward=leaf["reward"], recall=leaf["recall"])
    record |= dict(retrievals=leaf["trace"][-1][1], llm_calls=tree["llm_calls"], proxy_calls=tree["proxy_calls"])
    return record | dict(steps=leaf["depth"], generated_tokens=tokens, no_answer=float(leaf["why"] != "answer"))


def step_curves(trees):
    """[Fig. 3a-b] Cumulative recall of the context after each reasoning step, and queries per step, over questions."""
    traces = [(next(n for n in t["nodes"] if n["kind"] == "leaf")["trace"], t["row"]) for t in trees]
    at = lambda trace, s: trace[min(s, len(trace) - 1)] if s >= 0 else ([], 0)  # a finished path keeps its context
    steps, mean = range(max((len(tr) for tr, _ in traces), default=0)), lambda xs: round(sum(xs) / len(trees), 4)
    recall = [mean(context_recall(at(tr, s)[0], row) for tr, row in traces) for s in steps]
    queries = [mean(at(tr, s)[1] - at(tr, s - 1)[1] for tr, _ in traces) for s in steps]
    return dict(recall_by_step=recall, queries_by_step=queries)


def node_text(node):
    """A node's text on one line: a leaf's answer, an agent's output or a thought."""
    return " ".join(str(node.get("answer") if node["kind"] == "leaf" else node["text"]).split())


def prediction_of(tree, record, decoding):
    """One evaluated question: golds, prediction, the path in short (node kind: text), its outcome and cost."""
    path = " | ".join(f"{n['kind']}: {node_text(n)[:200]}" for n in tree["nodes"][1:])
    row, leaf = tree["row"], next(n for n in tree["nodes"] if n["kind"] == "leaf")
    return dict(id=row.get("id"), question=row["question"], decoding=decoding, golden_answers=row["golden_answers"],
                prediction=leaf["answer"], context=leaf["docs"], trajectory=path, **record)  # fmt: skip


@runs.evaluation
def evaluate(model, tokenizer, env, rows, args, greedy=True, seed=0, batch=256, predictions=None):
    """Alg. 1 on the rows (greedy [App. C] or T = 1), batched; a list `predictions` gets each question's path."""
    start, records, trees = time.time(), [], []
    mode, decoding = ("greedy", "greedy") if greedy else ("sample", "sampled")
    for s in runs.progress(range(0, len(rows), batch), "eval", not PartialState().is_main_process, leave=False):
        trees += rollout(rows[s : s + batch], proxy_actor(model, tokenizer, args, greedy), env, args, mode, seed + s)
        records += [tree_record(t) for t in trees[s:]]
        if predictions is not None:
            predictions += [prediction_of(t, r, decoding) for t, r in zip(trees[s:], records[s:])]
    # simplification: latency = batched wall time per question (header 7)
    return summarize(records, rows) | step_curves(trees) | {"latency_s": (time.time() - start) / max(len(rows), 1)}


def evaluate_stage(accelerator, out, stage, model, tokenizer, env, rows, args, step=None):
    """Greedy and sampled evaluations at a stage (raw, sft, ppo, eval), with predictions_<stage>.jsonl and logs."""
    kept = []
    with accelerator.autocast():
        greedy = evaluate(model, tokenizer, env, rows, args, greedy=True, predictions=kept)
        sampled = evaluate(model, tokenizer, env, rows, args, greedy=False, seed=args.seed + 10_000, predictions=kept)
    if accelerator.is_main_process:
        write_jsonl(out / f"predictions_{stage}.jsonl", kept)
    accelerator.print(f"{stage}: f1={greedy['f1']:.3f} recall={greedy['recall']:.3f} | sampled f1={sampled['f1']:.3f}")
    if step is not None:
        runs.log_eval(accelerator, out, stage, greedy | {"sampled": sampled}, step)
    return greedy | {"sampled": sampled}


# --------------------------------------------------------------------------- 9. train / eval / ask / triples
def environment(args):
    """The frozen retriever (with the KG corpus) and LLM, seen through each renamed question's names (header 12)."""
    llm = make_llm(args.llm, world=args.world, **({"model": args.llm_model} if args.llm_model else {}))
    triples = {} if args.ablation in ("no_ki", "direct_ki") else load_triples(args.triples)
    return toy.RenamingEnv(KGRetriever(open_retriever(args.index, args.corpus, args.encoder), triples), llm)


def load_proxy(args, device):
    """The proxy LM and its tokenizer: fp32 master weights (bf16 only through autocast, never Adam on bf16)."""
    return load_model_and_tokenizer(args.model, dtype=torch.float32, device=device, world=args.world)


def rollout_stats(trees, samples):
    """Logged rollout statistics of one PPO update."""
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    leaves = [n for t in trees for n in t["nodes"] if n["kind"] == "leaf"]
    out = {f"rollout/leaf_{k}": mean([n[k] for n in leaves]) for k in ("reward", "f1", "recall")}
    # this process's trees (none: a rollout shorter than the processes)
    pruned, per_tree = sum(n.get("pruned", False) for t in trees for n in t["nodes"]), max(len(trees), 1)
    out |= {"rollout/leaves_per_tree": len(leaves) / per_tree, "rollout/pruned_per_tree": pruned / per_tree}
    out |= {"rollout/samples": len(samples)} | {f"ops/{a}": sum(s["agent"] == a for s in samples) for a in AGENTS}
    return out | {f"credit/{a}": mean([s["credit"] for s in samples if s["agent"] == a]) for a in AGENTS}  # [Eq. 2]


def warm_up(accelerator, args, out, train_rows, test_rows, env, world, record):
    """The proxy after the warm-up SFT [§D.3] (trained, or loaded from sft/ with --resume) and the run's steps."""
    sft_dir = out / "sft"
    if (state := runs.load_state(sft_dir)) is not None:
        policy, tokenizer = load_proxy(replace(args, model=str(sft_dir)), accelerator.device)
        record["warnings"] += state["warnings"]
        return policy, tokenizer, state["before_sft"], {"sft": state["steps"], "ppo": 0}
    policy, tokenizer = load_proxy(args, accelerator.device)
    before_sft = evaluate_stage(accelerator, out, "raw", policy, tokenizer, env, test_rows, args)
    rows = toy.warmup_rows(train_rows, args.warmup_types)  # simplification: header 11
    served = {"model": args.teacher_llm_model} if args.teacher_llm_model else {}  # [§D.3] the teacher apart from --llm
    # empty: the frozen --llm plays the proxy roles; oracle: teacher_actor never asks it
    teacher = env.llm if args.teacher_model in ("oracle", "") else make_llm(args.teacher_model, **served)
    examples, solved = build_warmup(rows, teacher, env, args)
    accelerator.print(f"warm-up: {dict(Counter(e['agent'] for e in examples))}; {solved:.2f} of the questions solved")
    if not examples:  # the raw proxy goes on to PPO
        runs.nothing_to_train(accelerator, record["warnings"], "sft", "the teacher solved no question (check --llm)")
    policy, steps = sft(accelerator, policy, tokenizer, examples, args, world, out) if examples else (policy, 0)
    if accelerator.is_main_process:
        runs.save_checkpoint(sft_dir, policy, tokenizer, dict(record, before_sft=before_sft, steps=steps))
    return policy, tokenizer, before_sft, {"sft": steps, "ppo": 0}


def train(args):
    """Teacher warm-up data, SFT, PPO on binary tree rollouts, evaluation before and after; --resume continues."""
    start, (accelerator, out) = time.time(), runs.start(args, "sparkle")  # refuses a checkpoint without --resume
    train_rows = sample_rows(load_split(args.data_dir, "train", args.question_types), args.n_train, args.seed)
    if args.teacher_model == "oracle":  # simplification: the toy teacher reads the questions' metadata (header 10)
        require_metadata(train_rows, ("type", "entities", "relations"), args.data_dir, "--teacher_model oracle")
    test_rows, env = load_split(args.data_dir, "test", args.question_types)[: args.n_eval], environment(args)
    # what every checkpoint records beside its stage's state; warnings: the stages that trained on nothing
    record = dict(warnings=[], method="sparkle", data_dir=args.data_dir, world=args.world, args=asdict(args))
    world = toy.renaming_world(args.world, args.augment_p or args.rl_augment_p)  # simplification: header 12
    policy, tokenizer, before_sft, steps = warm_up(accelerator, args, out, train_rows, test_rows, env, world, record)
    before = evaluate_stage(accelerator, out, "sft", policy, tokenizer, env, test_rows, args, step=0)
    # ---- PPO: policy and critic with separate optimizers, reference = the SFT proxy, frozen [Tab. 6; impl]
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    # simplification: the critic's backbone per --critic_init (header 4)
    value = ValueModel(policy if args.critic_init == "sft" else load_proxy(args, accelerator.device)[0])
    optimizers = [torch.optim.Adam(m.parameters(), lr=lr, betas=(0.9, 0.95))
                  for m, lr in ((policy, args.policy_lr), (value, args.value_lr))]  # fmt: skip
    schedule = lambda s: cosine(s, args.ppo_iterations, max(1, int(0.03 * args.ppo_iterations)))  # [Tab. 6] cosine
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    rng = random.Random(args.seed * 1000 + accelerator.process_index)
    objects = lambda: dict(policy=accelerator.unwrap_model(policy), value=accelerator.unwrap_model(value),
                           optimizers=optimizers, schedulers=schedulers)  # fmt: skip
    if state := runs.load_training(accelerator, out / "ppo", objects(), rng):  # --resume
        steps["ppo"], record["warnings"] = state["iteration"], state["warnings"]  # the log goes on at iteration + 1
    curve = lambda rows: evaluate(objects()["policy"], tokenizer, env, rows, args)  # greedy, as at inference [§4.1]
    if steps["ppo"] == 0:  # the curve's start: the SFT proxy
        runs.curve_point(accelerator, out, args, 0, curve)
    policy, value, *optimizers = accelerator.prepare(policy, value, *optimizers)
    mode = "standard" if args.standard_rollout else "tree"  # w/ Standard Rollout [Tab. 4]; binary tree [§3.1]
    rd = lambda k: tokenizer.encode(TEMPLATES[args.templates][k], add_special_tokens=False) + [tokenizer.eos_token_id]
    canonical = {True: rd("rd_yes"), False: rd("rd_no")} if args.ablation != "no_qf" else None  # impl
    for it in range(steps["ppo"], args.ppo_iterations):
        t0 = time.time()
        share = len(range(accelerator.process_index, args.rollout_batch, accelerator.num_processes))
        rows = rng.sample(train_rows, min(share, len(train_rows)))  # this process's share of the rollout
        rows = toy.rename_rows(rows, world, rng, args.rl_augment_p)  # simplification: renamed trees (header 12)
        actor = proxy_actor(accelerator.unwrap_model(policy), tokenizer, args, greedy=False)
        with accelerator.autocast():
            trees = rollout(rows, actor, env, args, mode, args.seed * 100_003 + it * 7919 + accelerator.process_index)
        samples = op_samples(trees, canonical, args.code_shaping)
        if not (update := ppo_update(accelerator, policy, value, ref, optimizers, schedulers, samples,
                                     tokenizer.pad_token_id, args)):  # fmt: skip
            runs.nothing_to_train(accelerator, record["warnings"], f"ppo update {it + 1}", "no credited operation")
        stats = rollout_stats(trees, samples) | update | {"iteration": it + 1, "charts/seconds": time.time() - t0}
        runs.log_update(accelerator, out, stats, step=it + 1)
        steps["ppo"] = it + 1
        if (it + 1) % args.eval_every == 0 or it + 1 == args.ppo_iterations:
            runs.curve_point(accelerator, out, args, it + 1, curve)
            state = dict(record, iteration=it + 1)
            runs.save_training(accelerator, out / "ppo", objects()["policy"], tokenizer, state, objects(), rng)
    policy = accelerator.unwrap_model(policy)
    after = evaluate_stage(accelerator, out, "ppo", policy, tokenizer, env, test_rows, args, step=steps["ppo"])
    accelerator.end_training()
    results = runs.result_record("sparkle", args, before_sft, before, after, steps, time.time() - start)
    runs.write_results(out, results | {"warnings": record["warnings"]}, accelerator.is_main_process, TABLE)


def run_eval(args):
    """Evaluate --model (a checkpoint folder, or the untrained start) on the test split."""
    start, (accelerator, out) = time.time(), runs.start_eval(args)
    rows = load_split(args.data_dir, "test", args.question_types)[: args.n_eval]  # a bad data file fails first
    policy, tokenizer = load_proxy(args, accelerator.device)
    result = evaluate_stage(accelerator, out, "eval", policy, tokenizer, environment(args), rows, args)
    results = runs.result_record("sparkle", args, None, result, None, {"sft": 0, "ppo": 0}, time.time() - start)
    runs.write_results(out, results | {"warnings": []}, accelerator.is_main_process, TABLE)


def ask(args):
    """One question through Algorithm 1 with the greedy proxy, printing every node."""
    policy, tokenizer = load_proxy(args, runs.make_accelerator().device)
    if unknown := unknown_words(tokenizer, args.ask):
        print(f"warning: words the proxy's tokenizer does not know (read as <unk>): {' '.join(unknown)}")
    row = {"id": "ask", "question": args.ask, "golden_answers": [""], "metadata": {}}
    tree = rollout([row], proxy_actor(policy, tokenizer, args, greedy=True), environment(args), args, "greedy")[0]
    for n in tree["nodes"][1:]:
        print(f"step {n['depth']} {n['kind']}: {node_text(n)}" + (f" ({n['why']})" if n["kind"] == "leaf" else ""))


def extract_triples(args, batch=64):
    """The KG corpus of --corpus by --llm (impl prompt, zero-shot, greedy), written to --triples [§4.1, §D.3]."""
    llm = make_llm(args.llm, world=args.world, **({"model": args.llm_model} if args.llm_model else {}))
    docs, rows = load_corpus(args.corpus), []
    for s in runs.progress(range(0, len(docs), batch), "triples"):
        user = lambda d: {"role": "user", "content": f"Title: {d['title']}\nText: {d['text']}"}
        messages = [[{"role": "system", "content": EXTRACTION_PROMPT}, user(d)] for d in docs[s : s + batch]]
        for doc, reply in zip(docs[s : s + batch], llm.chat(messages, temperature=0.0, max_tokens=512)):
            for span in re.findall(r"<([^>]*)>", reply):  # impl: templates that still say "head entity" are dropped
                parts = [p.strip() for p in span.split(";")]
                if len(parts) == 3 and all(parts) and "head entity" not in span.lower():
                    rows.append(dict(doc_id=str(doc["id"]), head=parts[0], relation=parts[1], tail=parts[2]))
    write_jsonl(args.triples, rows)
    print(f"{len(rows)} triples of {len(docs)} documents -> {args.triples}")


def main(argv=None):
    """Parse the flags, fill the preset, dispatch on the mode."""
    if (flags := runs.parse_flags(Args, argv, PRESETS)).extract_triples:
        return extract_triples(apply_preset(flags))
    args = apply_preset(runs.parse_args(Args, argv, "the untrained proxy writes no valid action", "sparkle", PRESETS))
    (runs.dry_run if args.dry_run else train if args.train else run_eval if args.eval else ask)(args)


if __name__ == "__main__":
    runs.run_main(main)  # a user's mistake (bad file, missing field) ends in one line, not a traceback
