# C-3PO: Compact Plug-and-Play Proxy Optimization to Achieve Human-like Retrieval-Augmented Generation
# ICML 2025, arXiv:2502.06205v2 (equation and section tags cite this version). Docs: docs/c3po.md
"""C-3PO: a small proxy LM plays three agents between a frozen retriever and a frozen LLM; tree rollout, PPO.

One proxy, three instructions [§4.1]: the Reasoning Router picks a strategy, the Information Filter keeps documents,
the Decision Maker issues the next sub-query or stops; the LLM writes roadmap and answer [Alg. 1]. Warm-up SFT [§5.2],
then PPO with a centralized critic (Eq. 6-11): each tree-rollout node (Eq. 1-4) earns its leaves' mean reward (Eq. 5).

    python c3po.py --train --run_name c3po                    # toy world, tiny proxy, CPU: warm-up, SFT, PPO, eval
    python c3po.py --eval --model runs/c3po/ppo               # evaluate a checkpoint on the toy test split
    python c3po.py --ask "what is the birthplace of the director of zekil ?" --model runs/c3po/ppo
    accelerate launch c3po.py --train --preset paper --data_dir DATA --index INDEX --llm http://HOST/v1 --llm_model M

Departures from the paper, in both presets (each marked `# simplification: ... (header N)` where it lives):
1. --teacher llm plays the proxy roles zero-shot (the authors' pipeline adds 2 few-shot examples per prompt).
2. With --teacher llm a forced prefix (`[Retrieval]`) ends the user message instead of starting the reply.
3. RL starts from the final SFT model (the paper: the model after one of the three SFT epochs).
4. Advantages are whitened over the rollout of all processes (OpenRLHF; the paper is silent).
5. The value loss clips around the old values (OpenRLHF, 0.2) where Eq. 10 prints the MSE (--value_clip 0: Eq. 10).
6. The policy loss is a token mean over the minibatch (OpenRLHF) where Eq. 9 sums over each sequence's tokens.
7. The value head is zero-initialised (the paper does not say how).
8. SFT uses AdamW betas (0.9, 0.98) and a cosine floor of 0.1 x lr (Tab. 6 says only AdamW and cosine).
9. The LLM's roadmaps, answers and verdicts are capped at answer_max_tokens, 256 (the paper states none).
10. Latency is batched wall time per question (all questions advance together), not one question served at a time.
11. Prompts over --prompt_max_len (Tab. 7) and SFT pairs over --cutoff_len (Tab. 6) lose middle tokens (where: ours).
Toy-world adaptations, what only the toy preset changes (preset-only fields; the machinery: common/toy/c3po.py):
12. The warm-up teacher is an oracle reading the question's metadata, wrong with p = teacher_noise (0.2).
13. The warm-up keeps only the cheapest successful strategy's paths (warmup_select cheapest; paper preset: uniform).
14. SFT examples and not-popular PPO trees are entity-renamed for the proxy (augment_p, rl_augment_p).
15. The forced root tokens' policy loss is scaled by forced_weight 0.1 (paper preset 1: every node, §5.2).
16. The judge is cover-EM of the short toy answer, not the LLM judge of App. D.2 (--judge).
17. Compact templates, at most 6 documents (templates, max_documents).
18. Top-3 documents, smaller SFT and PPO sizes, 2 PPO epochs (ppo_epochs; top_k and the sizes: PRESETS' toy column).
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

from common import runs
from common.data import load_split, sample_rows, write_jsonl
from common.llm import backbone_of, chat_prompts, generate, right_pad, unknown_words
from common.metrics import answer_scores, cover_em, summarize
from common.models import load_model_and_tokenizer, make_llm
from common.retrieval import open_retriever
from common.runs import arg, cosine
from common.toy import RenamingEnv
from common.toy import c3po as toy

POSITIVE = 1e-12  # the low end of a number that must be > 0 (learning rates, the gradient-norm clip)


@dataclass
class Args:
    preset: str = arg("toy", "toy (toy world, tiny proxy, CPU) or paper", choices=["toy", "paper"], group="run")
    train: bool = arg(False, "teacher warm-up data, SFT, PPO, evaluation")
    eval: bool = arg(False, "evaluate --model (a checkpoint or the untrained start)")
    ask: str = arg("", "answer one question with --model and print the trajectory")
    output_dir: str | None = arg(None, "results, metrics, checkpoints (runs/<run_name>; --eval: <model>/eval/<time>)")
    run_name: str | None = arg(None, "a training run's name (default: c3po__<seed>__<time>)")
    resume: bool = arg(False, "continue the run --run_name / --output_dir from its last checkpoint")
    dry_run: bool = arg(False, "print the resolved configuration, check its paths and models, load nothing")
    report_to: str = arg("none", "tracker beside metrics.jsonl", choices=["none", "tensorboard", "wandb"])
    seed: int = arg(0, "seed of models, sampling and data order", low=0)
    eval_every: int | None = arg(None, "checkpoint and learning-curve point every this many PPO updates", low=1)
    data_dir: str | None = arg(None, "folder with train/test jsonl (FlashRAG QA)", group="data")
    corpus: str | None = arg(None, "FlashRAG corpus jsonl (default: data_dir's corpus.jsonl, else --world's)")
    world: str | None = arg(None, runs.WORLD_HELP)
    n_train: int | None = arg(None, "training questions (None: all) [Tab. 8: 6000 per dataset]", low=1)
    n_eval: int | None = arg(None, "test questions evaluated (None: all) [§6.1: 1000]", low=1)
    encoder: str | None = arg(None, "without --index: tfidf, bm25, dense encoder (hub id, folder)", group="retrieval")
    index: str = arg("", "saved retriever folder (python -m common.retrieval build) [§6.1: contriever, wiki-18]")
    top_k: int | None = arg(None, "documents per retrieval (impl: 10; a repeated query gets the next page)", low=1)
    model: str | None = arg(None, "proxy: hub id, folder or toy-lm spec [Tab. 6: Qwen2-0.5B/1.5B]", group="models")
    llm: str | None = arg(None, "frozen LLM: toy, hf:<name>, http(s)://.../v1 [§6.1: Qwen2-72B-Instruct]")
    llm_model: str = arg("", "served model name when --llm is an endpoint URL")
    judge: str | None = arg(None, "the App. D.2 judge prompt on --llm, or cover-EM", choices=["llm", "cover_em"])
    max_new_tokens: int | None = arg(None, "proxy (and LLM teacher) tokens per action [Tab. 7: 2048]", low=1)
    prompt_max_len: int = arg(4096, "proxy prompt tokens, the middle cut beyond (header 11) [Tab. 7: 4096]", low=1)
    gen_batch_size: int = arg(512, "prompts per proxy generate call (memory only)", low=1)
    max_depth: int = arg(13, "maximal tree depth in training [Tab. 7: 13]", low=1, group="tree rollout [§5.1]")
    branch_k: int = arg(2, "K(t) for t <= branch_until [Eq. 2: 2]", low=1)
    branch_until: int = arg(4, "last depth with K(t) = branch_k, then 1 [Eq. 2: 4]", low=0)
    credit_mode: str = arg("tree", "Eq. 5, or the w/o-tree ablation (§6.4)", choices=["tree", "single_trajectory"])
    warmup_keep: int = arg(4, "successful trajectories kept per question [§6.1: 4]", low=1, group="warm-up [§5.2]")
    teacher: str | None = arg(None, "the toy oracle, or the frozen LLM in the proxy roles", choices=["oracle", "llm"])
    sft_epochs: float | None = arg(None, "SFT epochs [Tab. 6: 3] (when --sft_steps is 0)", low=0.0)
    sft_steps: int | None = arg(None, "SFT steps; overrides epochs when > 0", low=0)
    sft_lr: float | None = arg(None, "SFT learning rate [Tab. 6: 4e-5]", low=POSITIVE)
    sft_batch_size: int | None = arg(None, "SFT batch size, over all processes [Tab. 6: 512]", low=1)
    cutoff_len: int = arg(4096, "SFT tokens of prompt + output, the prompt's middle cut beyond [Tab. 6: 4096]", low=1)
    micro_batch_size: int | None = arg(None, "sequences per forward pass (gradient accumulation)", low=1)
    ppo_iterations: int | None = arg(None, "PPO updates (chosen on validation; impl ~150)", low=1, group="PPO [§5.2]")
    rollout_batch: int | None = arg(None, "questions (trees) per PPO update, over all processes", low=1)
    ppo_batch_size: int | None = arg(None, "node samples per minibatch, over all processes [Tab. 7: 1024]", low=1)
    policy_lr: float | None = arg(None, "policy learning rate [Tab. 7: 5e-7]", low=POSITIVE)
    value_lr: float | None = arg(None, "value model learning rate [Tab. 7: 5e-6]", low=POSITIVE)
    kl_coef: float = arg(0.005, "KL coefficient beta, a per-token penalty in the reward [Tab. 7: 0.005]", low=0.0)
    value_clip: float = arg(0.2, "value clip around the old values (OpenRLHF: 0.2); 0: Eq. 10 as printed", low=0.0)
    # set by the presets only (toy-world tuning: header 12-18), or constants of the authors' code (impl, OpenRLHF)
    templates: str | None = arg(None, "App. B.1 as the authors write it, or compact (header 17)", flag=False)
    system_prompt: str | None = arg(None, "proxy system message (impl: 'You are a helpful assistant.')", flag=False)
    question_types: str | None = arg(None, "comma-separated metadata types to keep (empty: all)", flag=False)
    max_documents: int | None = arg(None, "more accumulated documents force [LLM] (impl: 10)", flag=False)
    warmup_select: str | None = arg(None, "all successes, or the cheapest strategy's (header 13)", flag=False)
    augment_p: float | None = arg(None, "entity-renaming probability of an SFT example (header 14)", flag=False)
    rl_augment_p: float | None = arg(None, "renaming probability of a not-popular PPO tree (header 14)", flag=False)
    forced_weight: float | None = arg(None, "policy-loss weight of forced root tokens (header 15)", flag=False)
    ppo_epochs: int | None = arg(None, "epochs over each rollout (OpenRLHF: 1; header 18)", flag=False)
    teacher_noise: float = arg(0.2, "the toy oracle's probability of a wrong action (0.2; header 12)", flag=False)
    teacher_temperature: float = arg(0.6, "llm teacher sampling temperature (impl: 0.6)", flag=False)
    max_depth_eval: int = arg(15, "maximal depth at test (impl: 15)", flag=False)
    roadmap_temperature: float = arg(0.3, "LLM roadmap temperature (impl: 0.3)", flag=False)
    max_query_words: int = arg(100, "queries truncated to this many words (impl: 100)", flag=False)
    answer_max_tokens: int = arg(256, "LLM tokens per answer, roadmap or verdict (ours, 256: header 9)", flag=False)
    gamma: float = arg(1.0, "GAE gamma within a node (OpenRLHF: 1)", flag=False)
    lam: float = arg(0.95, "GAE lambda (OpenRLHF: 0.95)", flag=False)
    clip: float = arg(0.2, "PPO clip epsilon [Eq. 9] (OpenRLHF: 0.2)", flag=False)
    vf_coef: float = arg(0.5, "c_v [Eq. 11] (OpenRLHF: 0.5)", flag=False)
    max_grad_norm: float = arg(1.0, "gradient clipping (OpenRLHF: 1.0)", flag=False)


PRESETS = {  # field: (toy, paper), for the fields left at None; any flag overrides them
    "data_dir": ("data/toy", "data/c3po"),
    "encoder": ("tfidf", "facebook/contriever-msmarco"),  # [§6.1]
    "model": ("toy-lm", "Qwen/Qwen2-0.5B"),  # [Tab. 6]
    "llm": ("toy", "hf:Qwen/Qwen2-72B-Instruct"),  # [§6.1]
    "judge": ("cover_em", "llm"),  # simplification: string match in the toy world (header 16)
    "top_k": (3, 10),  # impl
    "max_new_tokens": (20, 2048),  # [Tab. 7]
    "teacher": ("oracle", "llm"),  # simplification: the toy oracle teacher (header 12)
    "sft_epochs": (0.0, 3.0),  # [Tab. 6]
    "sft_steps": (1500, 0),
    "sft_lr": (2e-3, 4e-5),  # [Tab. 6]
    "sft_batch_size": (32, 512),  # [Tab. 6]
    "micro_batch_size": (8, 4),
    "ppo_iterations": (20, 150),  # impl
    "rollout_batch": (32, 64),
    "ppo_batch_size": (32, 1024),  # [Tab. 7]
    "policy_lr": (1e-4, 5e-7),  # [Tab. 7]
    "value_lr": (1e-3, 5e-6),  # [Tab. 7]
    "templates": ("compact", "paper"),  # simplification: no instruction prose in the toy world (header 17)
    "system_prompt": ("", "You are a helpful assistant."),  # impl; the toy proxy's vocabulary has no prose
    "question_types": ("", ""),  # every type: the paper's mix holds multi-hop datasets [§6.1, Tab. 8]
    "eval_every": (5, 10),  # a learning-curve point and a checkpoint every 5 of the toy's 20 updates
    "max_documents": (6, 10),  # impl; 6 of the toy world's short passages (header 17)
    "warmup_select": ("cheapest", "uniform"),  # simplification: the toy oracle's cheapest strategy (header 13)
    "augment_p": (1.0, 0.0),  # simplification: toy renaming, so facts are read, never memorised (header 14)
    "rl_augment_p": (1.0, 0.0),  # simplification: toy renaming of not-popular PPO trees (header 14)
    "forced_weight": (0.1, 1.0),  # simplification: the toy proxy overfits the forced roots (header 15)
    "ppo_epochs": (2, 1),  # simplification: the toy's few trees get two passes (header 18); OpenRLHF: 1
}


def apply_preset(args):
    """Fill the fields left at None from the preset's column; the toy world of the preset's data; --eval's folder."""
    for key, values in PRESETS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[args.preset == "paper"])
    world = args.world or runs.toy_world(None, args.data_dir)  # the preset's --data_dir may hold one
    args.world = world and str(Path(world).resolve())  # a checkpoint's world, found from any folder
    corpus = Path(args.data_dir) / "corpus.jsonl"  # one's own questions without a corpus: the toy world's
    args.corpus = args.corpus or str(corpus if corpus.is_file() or not args.world else Path(args.world) / corpus.name)
    if args.output_dir is None and args.eval:  # a new folder per evaluation, never over a training run's results
        args.output_dir = runs.eval_dir(args, "c3po")
    return args


# --------------------------------------------------------------------------- 1. prompts [App. B.1, D; impl strings]
# The paper set: the instructions of App. B.1 and D as the authors' code writes them (zero-shot, as the trained proxy
# runs); the compact set keeps the same fields and output formats without the prose (header 17).
PAPER_TEMPLATES = {
    # [App. B.1] Reasoning Router (impl: prompt/decision.py)
    "router": """\
You are an intelligent assistant tasked with evaluating whether a given question requires further information \
through retrieval or needs planning to arrive at an accurate answer. You will have access to a large language model \
(LLM) for planning or answering the question and a retrieval system to provide relevant information about the query.

Instructions:
1. **Evaluate the Question**: Assess whether a precise answer can be provided based on the existing knowledge of \
LLM. Consider the specificity, complexity, and clarity of the question.
2. **Decision Categories:**
    - If the question is complex and requires a planning phase before retrieval, your response should be:
    [Planning]
    - If the question requests specific information that you believe the LLM does not possess or pertains to recent \
events or niche topics outside LLM's knowledge scope, format your response as follows:
    [Retrieval] `YOUR QUERY HERE`
    - If you think the LLM can answer the question without additional information, respond with:
    [No Retrieval]
3. **Focus on Assessment**: Avoid providing direct answers to the questions. Concentrate solely on determining the \
necessity for retrieval or planning.

Now, process the following question:

Question: {question}""",
    # [App. B.1] Information Filter under [Planning], with the current objective (impl: FILTER_PROMPT)
    "filter_plan": """\
You are an intelligent assistant tasked with analyzing the retrieved documents based on a given question and the \
current step's objectives. Your role is to determine the relevance of each document in relation to the question and \
the specified objectives.

Instructions:
1. **Analyze Relevance**: Evaluate each document whether it aligns with the objectives of the current retrieval step \
and contains a direct answer to the question.
2. **Thought Process**: Provide a brief analysis for each document, considering both the answer content and the \
retrieval objectives.
3. **Filter Documents**: After your thought process, generate a list of document indices indicating which documents \
to retain.
4. **Output Format**:
Thought: [Your analysis for each document]
Action: [List of document indices to retain, separated by commas]

Now, process the following question:

Current step's objectives: {objective}

Question: {question}

Documents:
{documents}""",
    # [App. B.1] Information Filter under [Retrieval] (impl: FILTER_PROMPT_DIRECT_RETRIEVE)
    "filter_direct": """\
You are an intelligent assistant tasked with analyzing the retrieved documents based on a given question. Your role \
is to determine the relevance of each document in relation to the question.

Instructions:
1. **Analyze Relevance**: Evaluate each document whether it provides helpful and relevant information or contains a \
direct answer to the question.
2. **Thought Process**: Provide a brief analysis for each document.
3. **Filter Documents**: After your thought process, generate a list of document indices indicating which documents \
to retain.
4. **Output Format**:
Thought: [Your analysis for each document]
Action: [List of document indices to retain, separated by commas]

Now, process the following question:

Question: {question}

Documents:
{documents}""",
    # [App. B.1] Decision Maker (impl: decide_next_step; the paper writes Roadmap: for Plan:)
    "dm": """\
You are an intelligent assistant tasked with determining the next appropriate action based on the provided existing \
documents, plan, and question. You have access to a large language model (LLM) for answering question and a \
retrieval system for gathering additional documents. Your objective is to decide whether to write a query for \
retrieving relevant documents or to generate a comprehensive answer using the LLM based on the existing documents \
and plan.

Instructions:
1. **Evaluate Existing Documents**: Assess the existing documents to determine if it is sufficient to answer the \
question.
2. **Follow the Plan**: Understand the next steps outlined in the plan.
3. **Decision Categories:**
    - If the existing documents is insufficient and requires additional retrieval, respond with:
        [Retrieval] `YOUR QUERY HERE`
    - If the existing documents is adequate to answer the question, respond with:
        [LLM]
4. **Focus on Action**: Do not answer the question directly; concentrate on identifying the next appropriate action \
based on the existing documents, plan, and question.
5. **Output Format**:
Thought: [Your analysis for current situation (need retrieval for additional informations or use LLM to answer)]
Action: [Your decision based on the analysis (Retrieval or LLM)]

Now, process the following question:

Existing Documents: {documents}

Plan: {roadmap}

Question: {question}
""",
    # Decision Maker when [LLM] is forced (impl: decide_next_step_LLM)
    "dm_llm": """\
You are an intelligent assistant assigned to analyze useful information from the existing documents and plan for \
responding to a question.

Instructions:
1. **Evaluate Existing Documents**: Thoroughly review the provided documents to extract useful information relevant \
to the question.
2. **Decision Categories:**
    - After your analysis, you should respond with:
        [LLM]
3. **Focus on Action**: Focus solely on identifying and analyzing relevant information rather than answering the \
question directly.
4. **Output Format**:
Thought: [Provide a detailed analysis outlining the useful information.]
Action: [LLM]

Now, process the following question:

Existing Documents: {documents}

Plan: {roadmap}

Question: {question}
""",
    # [App. D.1] the LLM's roadmap
    "roadmap": """\
You are an expert assistant tasked with analyzing the following question and formulating a detailed plan. You will \
utilize a retrieval system to gather relevant information in your planning. Your goal is to analysis the question \
and provide a structured sequence of actions to address it effectively.

Instructions:

1. **Question Analysis**: Identifying the core components of the question. Determine what key information we \
currently know and what additional information is needed through retrieval.

2. **Step By Step Planning**: Develop a detailed plan step by step. Focus on the planning process rather than \
providing direct answers.

3. **Focus on Planning**: Keep your response clear and structured, concentrating solely on the analysis and planning \
aspects.

Now, process the following question:

Question: {question}""",
    # the LLM's answer with documents (impl: DOCUMENT_PROMPT; absent from the paper)
    "answer": """\
You are a knowledgeable assistant. Please answer the following question by:
1. First reviewing the provided documents. Please extract the relevant information and ignore irrelevant information \
about the question.
2. Combining relevant information from the documents (if any) with your own knowledge to generate a response.
3. Note that the question may be compositional and require intermediate analysis to deduce the final answer. Make \
sure your response is grounded and provides clear reasoning details followed by a concise conclusion.

Now, process the following question:
Existing documents: {documents}

Question: {question}""",
    # the LLM's answer without documents (impl: NO_DOCUMENT_PROMPT)
    "answer_no_docs": """\
Note that the question may be compositional and require intermediate analysis to deduce the final answer. Make sure \
your response is grounded and provides clear reasoning details followed by a concise conclusion.
Based on your knowledge, answer the question:
{question}""",
}
# [App. D.2] the LLM judge of a final answer
JUDGE_PROMPT = """\
You are a precise answer validator. Your task is to compare the predicted answer with a set of acceptable correct \
answers and determine if the prediction matches any of them.

Input format: Question: [The question text] Correct Answers: [Array or list of acceptable correct answers] Predicted \
Answer: [The answer to be evaluated]

Rules:

- 1. Consider semantic equivalence, not just exact string matching
- 2. Ignore minor differences in formatting, spacing, or capitalization
- 3. For numerical answers, consider acceptable margin of error if applicable
- 4. For text answers, focus on the core meaning rather than exact wording
- 5. The predicted answer is considered correct if it matches ANY ONE of the provided correct answers
- 6. The matching can be exact or semantically equivalent to any of the correct answers
- 7. Return only "True" if the predicted answer is correct, or "False" if it is incorrect.

Now, process the following question:
Question: {question}
Correct Answer: {golds}
Predicted Answer: {prediction}
"""

TEMPLATES = {"paper": PAPER_TEMPLATES, "compact": toy.COMPACT_TEMPLATES}  # compact: the toy preset (header 17)
ROUTER_ACTIONS = {"no retrieval": "No Retrieval", "retrieval": "Retrieval", "planning": "Planning"}  # [§4.1]
DM_ACTIONS = {"retrieval": "Retrieval", "llm": "LLM"}  # [§4.1]
AGENTS = ("router", "filter", "dm")  # [§3] N = {Reasoning Router, Information Filter, Decision Maker}


def format_documents(docs):
    """`Document {i} (Title: {title}): {text}`, 1-based, joined by blank lines (impl)."""
    return "\n\n".join(f"Document {i} (Title: {d['title']}): {d['text']}" for i, d in enumerate(docs, 1))


def llm_prompt(tpl, question, event):
    """The LLM's roadmap prompt [Alg. 1 L10], or its answer prompt with or without documents [Alg. 1 L3, L7, L18]."""
    if event[0] == "roadmap":
        return tpl["roadmap"].format(question=question)
    key = "answer" if event[1] else "answer_no_docs"  # format_documents([]) is "": the no-docs template ignores it
    return tpl[key].format(documents=format_documents(event[1]), question=question)


def placeholder(query):
    """The document an empty filter selection adds (impl)."""
    return {"title": query, "text": "None relevant information about " + query}


# --------------------------------------------------------------------------- 2. parsing [§4.1; impl regexes]
def visible(text):
    """What a model shows after its reasoning: the text after the last `</think>`, cut at an unclosed `<think>`."""
    return text.rpartition("</think>")[2].partition("<think>")[0].strip()


def _bracket(text, actions, max_query_words):
    """(action, query) of `[Action] query`, or None: unknown action, or a retrieval without a query (impl regex)."""
    m = re.search(r"\[(.*?)\](.*)", text, re.DOTALL)
    action = actions.get(" ".join(m.group(1).split()).lower()) if m else None
    query = " ".join(m.group(2).split()[:max_query_words]) if action == "Retrieval" else ""  # impl: <= 100 words
    return None if action is None or (action == "Retrieval" and not query) else (action, query)


def _thought_action(text):
    """(thought, action text) of `Thought: ... Action: ...` after any <think>, or None when the thought is empty."""
    # the authors' case-sensitive regex (impl); else, for a decoder that lower-cases, `action :` before a bracket
    text = visible(text)
    m = re.search(r"(?:Thought:\s*)?(.*?)\s*Action:\s*(.*)", text, re.DOTALL) or re.search(
        r"(?:thought\s*:\s*)?(.*?)\s*\baction\s*:\s*(?=\[)(.*)", text, re.DOTALL | re.IGNORECASE
    )
    return (m.group(1).strip(), m.group(2)) if m and m.group(1).strip() else None


def parse_router(text, max_query_words=100):
    """(action, query) of a Reasoning Router output after any <think> block, or None when invalid (R = 0) [§4.1]."""
    return _bracket(visible(text), ROUTER_ACTIONS, max_query_words)


def parse_filter(text, n_docs, strict=True):
    """(thought, 1-based ids, duplicates dropped) of a filter output, or None when invalid."""
    # an id out of range makes it invalid when strict (training), else it is dropped (impl)
    parts = _thought_action(text)
    m = re.search(r"\[(.*?)\]", parts[1]) if parts else None
    pieces = [p.strip() for p in m.group(1).split(",") if p.strip()] if m else None
    if pieces is None or not all(re.fullmatch(r"[+-]?\d+", p) for p in pieces):
        return None
    ids = [int(p) for p in pieces]
    if strict and any(not 1 <= i <= n_docs for i in ids):
        return None
    return parts[0], list(dict.fromkeys(i for i in ids if 1 <= i <= n_docs))


def parse_dm(text, max_query_words=100):
    """(thought, action, sub-query) of a Decision Maker output, or None when invalid [§4.1]."""
    parts = _thought_action(text)
    got = _bracket(parts[1], DM_ACTIONS, max_query_words) if parts else None
    return (parts[0], *got) if got else None


# --------------------------------------------------------------------------- 3. rewards and credit [§5.1, Eq. 5]
def score_leaves(trees, env, args):
    """R = 1 if the final answer is judged correct, else 0 [§5.1]; invalid and over-depth leaves keep R = 0."""
    leaves = [(t, n) for t in trees for n in t["nodes"] if n["kind"] == "leaf" and n["why"] == "answer"]
    if args.judge == "llm":  # [App. D.2]
        prompts = [JUDGE_PROMPT.format(question=t["row"]["question"], prediction=n["answer"],
                                       golds=str(t["row"]["golden_answers"])) for t, n in leaves]  # fmt: skip
        replies = env.chat([[{"role": "user", "content": p}] for p in prompts], [t["row"] for t, _ in leaves],
                           temperature=0.0, max_tokens=args.answer_max_tokens)  # fmt: skip
        rewards = [float("true" in visible(r).lower()) for r in replies]  # impl; a thinking judge's verdict
    else:  # simplification: a gold answer as a whole-token span of the short toy answer (header 16)
        rewards = [cover_em(n["answer"], t["row"]["golden_answers"]) for t, n in leaves]
    for (_, n), r in zip(leaves, rewards):
        n["reward"] = r


def leaf_credits(nodes):
    """Eq. 5 for every node (parents first): the mean reward of the leaves it reaches, not of its children's means."""
    total, count = [0.0] * len(nodes), [0] * len(nodes)
    for i in reversed(range(len(nodes))):
        if nodes[i]["kind"] == "leaf":
            total[i], count[i] = total[i] + nodes[i]["reward"], count[i] + 1
        parent = nodes[i]["parent"]
        if parent is not None:
            total[parent] += total[i]
            count[parent] += count[i]
    return [t / c if c else 0.0 for t, c in zip(total, count)]


# --------------------------------------------------------------------------- 4. tree rollout [§5.1, Eq. 1-4, Alg. 1]
# One tree per question [Eq. 4], grown level by level: the proxy acts on every pending agent state (router, filter,
# decision maker), each output goes through T(s, a) (transition), then the level's retrievals and LLM calls open the
# next states. Tree mode forces the three strategies at the root and samples K(t) children (Eq. 2) below.
def transition(agent, text, ctx, strict, max_query_words):
    """T(s_t, a_t) [Eq. 3; Eq. 12-15; Alg. 1]: the event an agent's output leads to, and the next state's context."""
    # ("answer", docs): the LLM answers; ("roadmap",): the LLM plans; ("search", query): retrieval, then the
    # Information Filter; ("decide",): the Decision Maker; ("invalid",): a leaf with R = 0 ("0 for failure", §5.1)
    c = dict(ctx, acc=list(ctx["acc"]), used=dict(ctx["used"]))
    if agent == "dm" and ctx["forced"]:  # a forced stop is [LLM] whatever it wrote (impl)
        return ("answer", c["acc"]), c
    if agent == "filter":
        parsed = parse_filter(text, len(ctx["docs"]), strict)
    else:
        parsed = (parse_router if agent == "router" else parse_dm)(text, max_query_words)
    if parsed is None:
        return ("invalid",), c
    if agent == "router":
        c["strategy"] = parsed[0]
        # [Alg. 1] No Retrieval: Answer <- LLM(q) (L2-3); Retrieval: docs <- Retrieval(<query content>) (L4-5, Eq. 12);
        # Planning: Roadmap <- LLM(q) (L10, Eq. 13)
        events = {"No Retrieval": ("answer", []), "Retrieval": ("search", parsed[1]), "Planning": ("roadmap",)}
        return events[parsed[0]], c
    if agent == "filter":
        chosen = [ctx["docs"][i - 1] for i in parsed[1]] or [placeholder(ctx["query"])]
        if ctx["strategy"] == "Retrieval":  # [Alg. 1 L6-7] Answer <- LLM(q, selected docs)
            return ("answer", chosen), c
        c["used"][ctx["query"]] = c["used"].get(ctx["query"], 0) + 1  # [Alg. 1 L15, Eq. 15] accumulate (impl: dedup)
        c["acc"] += [d for d in chosen if d not in c["acc"]]
        if parsed[1] and c["used"][ctx["query"]] > 1:
            c["acc"] = [d for d in c["acc"] if d != placeholder(ctx["query"])]
        return ("decide",), c
    if parsed[1] == "LLM":  # [Alg. 1 L12, L18] Answer <- LLM(q, accumulated docs)
        return ("answer", c["acc"]), c
    c["objective"] = parsed[0]  # [Alg. 1 L13, Eq. 14] the Decision Maker's thought is the filter's objective
    return ("search", parsed[2]), c


def branching(depth, k=2, until=4):
    """K(t) = 2 if t <= 4 else 1 [Eq. 2]; the depth of the node being generated is the time step (footnote 2)."""
    return k if depth <= until else 1


def dm_forced(n_docs, dm_depth, max_documents, max_depth):
    """The Decision Maker must answer when docs > max_documents or its parent is deeper than max_depth - 4 (impl)."""
    return n_docs > max_documents or dm_depth - 1 > max_depth - 4


@dataclass
class Request:
    """A pending agent state s_t [Eq. 3]: the proxy (or teacher) writes n outputs for it (fixed: a forced output)."""

    tree: dict
    parent: int  # the node the agent's output hangs below
    agent: str  # router, filter or dm
    depth: int
    prompt: str
    ctx: dict  # what the state holds: accumulated docs, queries used, roadmap, objective, retrieved docs, strategy
    n: int
    prefix: str = ""
    fixed: str | None = None


@dataclass
class ToolCall:
    """A retrieval (kind search, text the query) or an LLM call (roadmap or answer, text the prompt) of a node."""

    tree: dict
    node: int
    ctx: dict
    kind: str
    text: str


@dataclass
class Level:
    """What one level of the trees hands on: the next agent states, the retrievals and the LLM calls [Alg. 1]."""

    requests: list = field(default_factory=list)
    searches: list = field(default_factory=list)
    calls: list = field(default_factory=list)


@dataclass
class Expansion:
    """How a rollout grows its trees: tree (forced top, then K(t) samples: RL and warm-up), single_trajectory (one
    sampled path, the §6.4 ablation), greedy / sample (inference, Alg. 1)."""

    args: Args
    mode: str

    def __post_init__(self):
        self.testing = self.mode in ("greedy", "sample")
        self.max_depth = self.args.max_depth_eval if self.testing else self.args.max_depth
        self.tpl = TEMPLATES[self.args.templates]

    def k(self, depth):
        """K(t) [Eq. 2] in tree mode, else one child."""
        return branching(depth, self.args.branch_k, self.args.branch_until) if self.mode == "tree" else 1


def add_node(tree, parent, kind, depth, **fields):
    """Append a node to a tree; returns its index (children always come after their parent)."""
    tree["nodes"].append(dict(kind=kind, parent=parent, depth=depth, **fields))
    return len(tree["nodes"]) - 1


def add_leaf(tree, parent, why, answer=""):
    """A leaf below `parent`: an answer (scored later), an invalid output or the depth cap (R = 0)."""
    add_node(tree, parent, "leaf", tree["nodes"][parent]["depth"] + 2, reward=0.0, why=why, answer=answer)


def router_requests(tree, mode, args):
    """The Reasoning Router's state S^1 = {q}; in tree mode the three strategies are forced [§5.1]."""
    prompt = TEMPLATES[args.templates]["router"].format(question=tree["row"]["question"])
    ctx = dict(acc=[], used={}, roadmap="", objective="", docs=[], query="", strategy="")
    forced = [dict(fixed="[No Retrieval]"), dict(prefix="[Retrieval]"), dict(fixed="[Planning]")]
    return [Request(tree, 0, "router", 1, prompt, ctx, 1, **f) for f in (forced if mode == "tree" else [{}])]


def decision_maker(x, tree, parent, ctx, depth):
    """The Decision Maker's state S^3 = {q, accumulated documents, roadmap} [Eq. 13, 15], or a leaf past the cap."""
    if depth > x.max_depth:
        add_leaf(tree, parent, "max_depth")
        return []
    forced = dm_forced(len(ctx["acc"]), depth, x.args.max_documents, x.max_depth)
    docs, question = format_documents(ctx["acc"]), tree["row"]["question"]
    prompt = x.tpl["dm_llm" if forced else "dm"].format(documents=docs, roadmap=ctx["roadmap"], question=question)
    return [Request(tree, parent, "dm", depth, prompt, dict(ctx, forced=forced), x.k(depth))]


def expand(x, req, outputs, level):
    """An agent's outputs a ~ pi(.|s) [Eq. 1] as child nodes, each through T(s, a) [Eq. 3]: a leaf (invalid output,
    R = 0), the Decision Maker's next state, or a retrieval or LLM call for the level."""
    tree = req.tree
    for text, prompt_ids, action_ids in {o[0]: o for o in outputs}.values():  # impl: identical children once
        tree["proxy_calls"] += 1
        fields = dict(text=text, prompt=req.prompt, prompt_ids=prompt_ids, action_ids=action_ids)
        node = add_node(tree, req.parent, req.agent, req.depth, **fields, fixed=req.fixed, prefix=req.prefix)
        event, ctx = transition(req.agent, text, req.ctx, not x.testing, x.args.max_query_words)  # [Eq. 3]
        if req.agent == "router" and event[0] != "invalid":
            tree["nodes"][node]["strategy"] = ctx["strategy"]
        if event[0] == "invalid":
            add_leaf(tree, node, "invalid")
        elif event[0] == "decide":
            level.requests += decision_maker(x, tree, node, ctx, req.depth + 1)
        elif event[0] == "search":
            level.searches.append(ToolCall(tree, node, ctx, "search", event[1]))
        else:  # the LLM answers or writes the roadmap
            prompt = llm_prompt(x.tpl, tree["row"]["question"], event)
            level.calls.append(ToolCall(tree, node, ctx, event[0], prompt))


def retrieve(x, searches, env):
    """One retrieval call for the level's queries [Alg. 1 L5, L14; Eq. 12]; each result opens an Information Filter
    state S^2 [Eq. 12, 14] (or a leaf at the depth cap). A query repeated in a path gets the next page (impl)."""
    if not searches:
        return []
    requests, pages = [], [s.ctx["used"].get(s.text, 0) for s in searches]
    hits = env.search([s.text for s in searches], x.args.top_k * (max(pages) + 1), [s.tree["row"] for s in searches])
    for s, page, found in zip(searches, pages, hits):
        s.tree["retrievals"] += 1
        s.ctx.update(docs=found[page * x.args.top_k : (page + 1) * x.args.top_k], query=s.text)
        depth = s.tree["nodes"][s.node]["depth"] + 1
        if depth > x.max_depth:
            add_leaf(s.tree, s.node, "max_depth")
            continue
        key = "filter_plan" if s.ctx["strategy"] == "Planning" else "filter_direct"  # S^2 [Eq. 12, 14]
        docs, question = format_documents(s.ctx["docs"]), s.tree["row"]["question"]
        prompt = x.tpl[key].format(objective=s.ctx["objective"], question=question, documents=docs)
        requests.append(Request(s.tree, s.node, "filter", depth, prompt, s.ctx, x.k(depth)))
    return requests


def ask_llm(x, calls, env):
    """The frozen LLM's calls of the level, one per kind: a roadmap [Alg. 1 L10, Eq. 13] opens the Decision Maker's
    state; an answer [Alg. 1 L3, L7, L12, L18] is a leaf."""
    requests = []
    for kind in ("roadmap", "answer"):
        todo = [c for c in calls if c.kind == kind]
        if not todo:
            continue
        messages, rows = [[{"role": "user", "content": c.text}] for c in todo], [c.tree["row"] for c in todo]
        temperature = x.args.roadmap_temperature if kind == "roadmap" else 0.0  # impl
        # simplification: a cap on the LLM's output (header 9)
        replies = env.chat(messages, rows, temperature=temperature, max_tokens=x.args.answer_max_tokens)
        for c, reply in zip(todo, map(visible, replies)):  # a thinking LLM's reply
            c.tree["llm_calls"] += 1
            if kind == "answer":
                add_leaf(c.tree, c.node, "answer", answer=reply.strip())
                continue
            road = add_node(c.tree, c.node, "roadmap", c.tree["nodes"][c.node]["depth"] + 1, text=reply.strip())
            depth = c.tree["nodes"][road]["depth"] + 1
            requests += decision_maker(x, c.tree, road, dict(c.ctx, roadmap=reply.strip()), depth)
    return requests


def rollout(rows, act, env, args, mode, seed=0):
    """Trees of a batch of questions, level by level: per level one proxy call (`act`) for all pending agent states,
    one retrieval call, one LLM call per kind; then each leaf's reward R [§5.1]."""
    x = Expansion(args, mode)
    # [Eq. 4] one tree per question: its nodes hold the trajectories {(s_t, a_t, s_t+1)} of all its paths
    trees = [dict(row=r, nodes=[dict(kind="root", parent=None, depth=0)], retrievals=0, llm_calls=0, proxy_calls=0)
             for r in rows]  # fmt: skip
    requests, step = [req for t in trees for req in router_requests(t, mode, args)], 0
    while requests:
        level = Level()
        for req, outputs in zip(requests, act(requests, seed + 1000 * step)):  # [Eq. 1] a ~ pi(.|s, instruction)
            expand(x, req, outputs, level)
        requests, step = level.requests + retrieve(x, level.searches, env) + ask_llm(x, level.calls, env), step + 1
    score_leaves(trees, env, args)
    return trees


# --------------------------------------------------------------------------- 5. the proxy and the teacher as actors
def encode_prompts(tokenizer, prompts, system_prompt, keep=math.inf):
    """Token ids of agent prompts as single-turn chats (system + user, generation prompt) (impl), cut to `keep`."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    texts = chat_prompts(tokenizer, [system + [{"role": "user", "content": p}] for p in prompts])
    return [cut_middle(ids, keep) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def cut_middle(ids, keep):
    """ids with their middle dropped beyond `keep` tokens: the instruction's start and the question's end stay."""
    return ids if len(ids) <= keep else ids[: keep // 2] + ids[len(ids) - (keep - keep // 2) :]


def question_rng(seed, row, *node):
    """A random stream of one question (and node): the same on any process, for any split of the questions."""
    return random.Random(":".join(map(str, (seed, row.get("id"), row["question"], *node))))


def proxy_actor(model, tokenizer, args, greedy):
    """act(requests, seed) -> per request [(text, prompt_ids, action_ids)]: one generate call (per gen_batch_size)."""

    def act(requests, seed):
        # [Tab. 7] prompt max len, the middle cut beyond (header 11)
        prompts = encode_prompts(tokenizer, [r.prompt for r in requests], args.system_prompt, args.prompt_max_len)
        out, batch, owners = [[] for _ in requests], [], []
        for i, (r, p) in enumerate(zip(requests, prompts)):
            if r.fixed is not None:  # a forced text: tokenised, trained like a sampled one [§5.2]
                fixed = tokenizer(r.fixed, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                out[i].append((r.fixed, p, fixed))
                continue
            prefix = tokenizer(r.prefix, add_special_tokens=False)["input_ids"] if r.prefix else []
            batch += [p + prefix] * r.n
            owners += [(i, prefix)] * r.n
        model.eval()
        for s in range(0, len(batch), args.gen_batch_size):
            chunk = batch[s : s + args.gen_batch_size]  # T = 1: the behaviour policy is pi_theta (OpenRLHF)
            gen = generate(model, tokenizer, chunk, args.max_new_tokens, do_sample=not greedy, seed=seed + s)
            for (i, prefix), ids, fed in zip(owners[s : s + args.gen_batch_size], gen.token_ids, gen.prompt_ids):
                read = fed[: len(fed) - len(prefix)]  # the prompt as generated from: PPO scores this very context
                out[i].append((tokenizer.decode(prefix + ids, skip_special_tokens=True), read, prefix + ids))
        return out

    return act


def teacher_actor(args, llm):
    """The warm-up teacher as an actor [§5.2]: the toy oracle (draws seeded by question and node), or the LLM."""

    def act(requests, _seed):
        free = [r for r in requests if not r.fixed for _ in range(r.n)]
        if args.teacher == "oracle":  # simplification: the toy world's stand-in for C-3PO-ICL (header 12)
            rng_of = lambda r: question_rng(args.seed, r.tree["row"], r.parent, r.prefix)  # seeded by question, node
            replies = toy.oracle_replies(free, rng_of, args.teacher_noise, args.templates)
        else:  # simplification: zero-shot (header 1); a forced prefix ends the user message (header 2)
            system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
            user = lambda r: {"role": "user", "content": (r.prompt + "\n" + r.prefix).strip()}
            sampling = dict(temperature=args.teacher_temperature, max_tokens=args.max_new_tokens)  # the proxy's cap
            # a thinking LLM's reasoning is not the output
            raw = map(visible, llm.chat([system + [user(r)] for r in free], **sampling))
            # a reply that repeats the forced prefix (`[Retrieval] q` after `... [Retrieval]`) keeps it once
            replies = (f"{r.prefix} {next(raw).strip().removeprefix(r.prefix).strip()}".strip() for r in free)
        texts = [[r.fixed] if r.fixed else [next(replies) for _ in range(r.n)] for r in requests]
        return [[(text, None, None) for text in group] for group in texts]

    return act


# --------------------------------------------------------------------------- 6. warm-up [§5.2: rejection sampling]
def successful_paths(tree, keep, rng, select="uniform"):
    """The (prompt, output) pairs of the agent nodes on up to `keep` random successful paths (cheapest: header 13)."""
    nodes = tree["nodes"]
    wins = [i for i, n in enumerate(nodes) if n["kind"] == "leaf" and n["reward"] == 1]
    if select == "cheapest":  # simplification: the toy oracle's cheapest strategy only (header 13)
        wins = toy.cheapest(nodes, wins)
    pairs = {}
    for i in rng.sample(wins, min(keep, len(wins))):
        while i is not None:
            if nodes[i]["kind"] in AGENTS:
                pairs[(nodes[i]["prompt"], nodes[i]["text"])] = nodes[i]["kind"]
            i = nodes[i]["parent"]
    return [dict(prompt=p, output=o, agent=a, row=tree["row"]) for (p, o), a in pairs.items()]


def build_warmup(rows, llm, env, args, batch=128):
    """SFT examples from teacher tree rollouts (forced top, K(t)), successful paths only, and the share solved."""
    # built once over the processes (runs.map_shared), each tree's draws seeded by its question: the same oracle set
    # for any process count
    quiet = not PartialState().is_local_main_process

    def solve(part):  # per question: its examples
        found = []
        for s in runs.progress(range(0, len(part), batch), "warm-up trees", disable=quiet, leave=False):
            for tree in rollout(part[s : s + batch], teacher_actor(args, llm), env, args, "tree"):
                rng = question_rng(args.seed, tree["row"])
                found.append(successful_paths(tree, args.warmup_keep, rng, args.warmup_select))
        return found

    per_question = runs.map_shared(solve, rows)
    return [e for got in per_question for e in got], sum(map(bool, per_question)) / max(len(rows), 1)


def sft_batch(pairs, tokenizer, args):
    """(ids, labels, attention) sorted by length: chat prompt + output + EOS, loss on the output only [Tab. 6]."""
    seqs = []
    for prompt, output in pairs:
        target = tokenizer(output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        room = max(args.cutoff_len - len(target), args.cutoff_len // 2)  # outputs (<= --max_new_tokens) fit in half
        prompt = encode_prompts(tokenizer, [prompt], args.system_prompt, room)[0]  # the middle cut (header 11)
        seqs.append((prompt + target, [-100] * len(prompt) + target))
    seqs.sort(key=lambda s: len(s[0]))  # micro-batches of similar lengths: less padding, the same gradient
    ids, labels = right_pad([s[0] for s in seqs], tokenizer.pad_token_id), right_pad([s[1] for s in seqs], -100)
    return ids, labels, right_pad([[1] * len(s[0]) for s in seqs], 0)


def sft(accelerator, model, tokenizer, examples, args, world, out):
    """Cross-entropy on the warm-up outputs (runs.sft_step), AdamW, 3% warm-up, cosine [Tab. 6]; logs sft/loss."""
    rng = random.Random(args.seed)
    steps = (args.sft_steps or math.ceil(args.sft_epochs * len(examples) / args.sft_batch_size)) if examples else 0
    # simplification: betas and the cosine floor are ours (header 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine(s, steps, max(1, int(0.03 * steps))))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    order, losses, every = [], [], min(100, max(1, steps // 10))
    for step in range(steps):
        if len(order) < args.sft_batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = order[: args.sft_batch_size], order[args.sft_batch_size :]
        pairs = [[examples[i]["prompt"], examples[i]["output"]] for i in batch]
        pairs = toy.rename_pairs(pairs, world, rng, args.augment_p)  # simplification: toy renaming (header 14)
        own, weight = runs.own_share(pairs, accelerator)  # this process's share of the batch
        step_args = (*sft_batch(own, tokenizer, args), args.micro_batch_size, 1.0, weight)
        losses.append(runs.sft_step(accelerator, model, optimizer, scheduler, *step_args))
        if (step + 1) % every == 0 or step + 1 == steps:  # the mean since the last line
            runs.log_update(accelerator, out, {"sft/step": step + 1, "sft/loss": sum(losses) / len(losses)}, step + 1)
            losses = []
    return accelerator.unwrap_model(model), steps


# --------------------------------------------------------------------------- 7. PPO [§5.2, App. A.1, Eq. 6-11]
class ValueModel(torch.nn.Module):
    """The centralized critic V_phi [App. A.1]: the SFT proxy's backbone (no LM head) and a scalar head."""

    def __init__(self, policy):
        super().__init__()
        self.backbone = backbone_of(copy.deepcopy(policy))
        self.head = torch.nn.Linear(policy.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.head.weight)  # simplification: zero-initialised head (header 7)

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)  # (B, T)


def node_samples(trees, count_tokens=None):
    """One PPO sample per agent node [§5.2]: ids, loss_mask 1 exactly on the action, Eq. 5 credit, forced tokens."""
    samples = []
    for tree in trees:
        credits = leaf_credits(tree["nodes"])  # [Eq. 5]
        for n, credit in zip(tree["nodes"], credits):
            if n["kind"] in AGENTS and n["action_ids"]:
                prefix = count_tokens(n["prefix"]) if n.get("prefix") and count_tokens else 0
                forced = len(n["action_ids"]) if n.get("fixed") is not None else prefix
                mask = [0] * len(n["prompt_ids"]) + [1] * len(n["action_ids"])
                ids = n["prompt_ids"] + n["action_ids"]
                samples.append(dict(ids=ids, credit=credit, agent=n["kind"], forced=forced, loss_mask=mask))
    return samples


def gae(rewards, values, gamma, lam):
    """GAE within one node's action tokens, V after the last token = 0 (OpenRLHF): (A, G = A + V) [Eq. 9-10]."""
    advantages, last = [0.0] * len(rewards), 0.0
    for m in reversed(range(len(rewards))):
        next_value = values[m + 1] if m + 1 < len(rewards) else 0.0
        last = rewards[m] + gamma * next_value - values[m] + gamma * lam * last
        advantages[m] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def token_rewards(credit, logp_old, logp_ref, beta):
    """Per-token reward -beta * (log pi_old - log pi_ref), plus the node's credit at its last token (OpenRLHF)."""
    rewards = [-beta * (o - r) for o, r in zip(logp_old, logp_ref)]
    rewards[-1] += credit
    return rewards


def clipped_surrogate(new_logp, old_logp, advantages, mask, clip, weights=None):
    """-mean over action tokens of min(r A, clip(r, 1-eps, 1+eps) A) [Eq. 9], and r; weights scale tokens' terms."""
    ratio = torch.exp(new_logp - old_logp)  # (B, T)
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    weighted = surrogate * mask if weights is None else surrogate * mask * weights
    return -weighted.sum() / mask.sum().clamp(min=1), ratio  # simplification: a token mean (header 6)


def value_loss(values, old_values, returns, mask, clip):
    """Token mean of (V - G)^2 [Eq. 10]; clip > 0: of max((V - G)^2, (V_old + clip(V - V_old) - G)^2) (OpenRLHF)."""
    loss = (values - returns) ** 2  # (B, T)
    if clip > 0:  # simplification: OpenRLHF's value clipping (header 5)
        loss = torch.max(loss, (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


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
    """Old and reference log-probs and values, then per-token rewards and GAE per node, written into the samples."""
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


def ppo_update(accelerator, policy, value, ref, optimizers, schedulers, samples, pad, args, weight=1.0):
    """Score the node samples, whiten the advantages, then minibatches over all agents and processes [Eq. 6-11]."""
    # --rollout_batch and --ppo_batch_size count over all processes; weight 0: own_share's stand-in trees, which run
    # the passes DDP waits for and count nothing
    device, n_proc, total = accelerator.device, accelerator.num_processes, lambda x: runs.global_sum(accelerator, x)
    policy.eval()
    score_samples(accelerator.unwrap_model(policy), ref, accelerator.unwrap_model(value), samples, pad, device, args)
    # simplification: advantages whitened over the rollout of every process (header 4)
    flat = torch.tensor([a for s in samples for a in s["adv"]])
    count = total(len(flat) * weight)
    mean = (total(flat.sum() * weight) / count).item()
    std = (total(((flat - mean) ** 2).sum() * weight) / (count - 1).clamp(min=1)).sqrt().item()
    ids, attention, mask = batch_tensors(samples, pad, device)  # pad once: (N, T), (N, T), (N, T-1)
    on_mask = lambda values: torch.zeros_like(mask).masked_scatter(mask.bool(), torch.tensor(values, device=device))
    old, v_old, returns = (on_mask([x for s in samples for x in s[k]]) for k in ("old", "val", "ret"))
    advantages = on_mask([(x - mean) * (1 / (std + 1e-8)) for s in samples for x in s["adv"]])
    forced = lambda s: [args.forced_weight] * s.get("forced", 0) + [1.0] * (len(s["adv"]) - s.get("forced", 0))
    weights = on_mask([w for s in samples for w in forced(s)])  # header 15
    lengths = [len(s["ids"]) for s in samples]
    policy.train()
    stats, rng = defaultdict(list), random.Random(args.seed + len(samples))
    n_mb = max(1, math.ceil(total(len(samples) * weight).item() / args.ppo_batch_size))  # the same on every process
    for _ in range(args.ppo_epochs):
        order = rng.sample(range(len(samples)), len(samples))
        for b in range(n_mb):
            # this process's part of minibatch b, length-sorted (less padding); none: a stand-in that counts nothing
            mb, w = (sorted(order[b::n_mb], key=lengths.__getitem__), weight) if b < len(order) else (order[:1], 0.0)
            scale = n_proc * w / total(mask[mb].sum() * w).clamp(min=1)  # token mean over the minibatch (header 6)
            sums = dict.fromkeys(("policy", "value", "clipfrac", "approx_kl"), 0.0)  # summed over micro-batches

            def loss_of(part, critic=False):
                """Micro-batch `part` of mb, cut to its longest: its term of the policy loss, or of the value loss."""
                r, t = torch.tensor(mb[part], device=device), slice(0, max(lengths[i] for i in mb[part]) - 1)
                x, att, msk = ids[r, : t.stop + 1], attention[r, : t.stop + 1], mask[r, t]  # (B, T), (B, T), (B, T-1)
                if critic:  # [Eq. 10]
                    vf = value_loss(value(x, att)[:, :-1].float(), v_old[r, t], returns[r, t], msk, args.value_clip)
                    sums["value"] += float(vf.detach() * msk.sum() * scale)
                    return args.vf_coef * vf * msk.sum() * scale
                logp = token_logp(policy, x, att)  # (B, T-1); [Eq. 9]
                pg, ratio = clipped_surrogate(logp, old[r, t], advantages[r, t], msk, args.clip, weights[r, t])
                log_ratio = (logp - old[r, t]).detach()
                sums["clipfrac"] += float((((ratio - 1).abs() > args.clip).float() * msk).sum() * scale)
                sums["approx_kl"] += float((((log_ratio.exp() - 1) - log_ratio) * msk).sum() * scale)  # k3
                return pg * msk.sum() * scale

            for opt in optimizers:
                opt.zero_grad()
            # [Eq. 11] L_CLIP + c_v L_V; all agents' nodes share the minibatch, the sum of Eq. 6 and 8, which
            # maximises the expected credit of Eq. 7; policy and critic are separate networks: a backward each, in
            # micro-batches of --micro_batch_size, DDP's all-reduce once per minibatch (runs.micro_backward)
            sums["policy"] = runs.micro_backward(accelerator, policy, len(mb), args.micro_batch_size, loss_of)
            runs.micro_backward(accelerator, value, len(mb), args.micro_batch_size, lambda part: loss_of(part, True))
            for key, x in zip(sums, total(torch.tensor(list(sums.values()))).tolist()):  # over the processes
                stats[f"losses/{key}"].append(x / n_proc)
            for model, opt in zip((policy, value), optimizers):
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                opt.step()
    for sched in schedulers:  # one scheduler step per PPO update (per rollout)
        sched.step()
    kl = [o - r for s in samples for o, r in zip(s["old"], s["ref"])]
    ret, val = returns[mask.bool()].cpu(), v_old[mask.bool()].cpu()
    explained = (1 - (ret - val).var() / ret.var().clamp(min=1e-8)).item() if len(ret) > 1 else 0.0
    out = {k: sum(v) / len(v) for k, v in stats.items()} | {"rollout/kl": sum(kl) / max(len(kl), 1)}
    return out | {"losses/explained_variance": explained}


# --------------------------------------------------------------------------- 8. train [§5.2]
# the end-of-run table: the judge's accuracy [Tab. 1], the answer's scores, the cost per question [Fig. 3]
TABLE_ROWS = ("accuracy", "em", "f1", "acc", "retrievals", "llm_calls", "proxy_calls", "generated_tokens", "latency_s")


def environment(args):
    """The frozen retriever and LLM, seen through each renamed question's names (header 14; others unchanged)."""
    llm = make_llm(args.llm, world=args.world, **({"model": args.llm_model} if args.llm_model else {}))
    return RenamingEnv(open_retriever(args.index, args.corpus, args.encoder), llm)


def load_proxy(args, device):
    """The proxy LM and its tokenizer: fp32 master weights (bf16 only through autocast, never Adam on bf16)."""
    return load_model_and_tokenizer(args.model, dtype=torch.float32, device=device, world=args.world)


def rollout_stats(trees, samples):
    """Logged rollout statistics of one PPO update."""
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    leaves = [n for t in trees for n in t["nodes"] if n["kind"] == "leaf"]
    rewards, invalid = [n["reward"] for n in leaves], [n["why"] != "answer" for n in leaves]
    out = {"rollout/leaf_reward": mean(rewards), "rollout/leaves_per_tree": len(leaves) / len(trees)}
    out |= {"rollout/samples": len(samples), "rollout/invalid": mean(invalid)}
    out |= {f"credit/{a}": mean([s["credit"] for s in samples if s["agent"] == a]) for a in AGENTS}  # [Eq. 5]
    credits = [(n.get("strategy"), c) for t in trees for n, c in zip(t["nodes"], leaf_credits(t["nodes"]))]
    return out | {f"strategy_credit/{k}": mean([c for s, c in credits if s == k]) for k in ROUTER_ACTIONS.values()}


def warm_up(accelerator, args, out, train_rows, test_rows, env, world):
    """The proxy after the warm-up SFT [§5.2] (trained, or the run's sft/ checkpoint: --resume), and its warnings."""
    sft_dir = out / "sft"
    if (state := runs.load_state(sft_dir)) is not None:
        policy, tokenizer = load_proxy(replace(args, model=str(sft_dir)), accelerator.device)
        return policy, tokenizer, state["before_sft"], {"sft": state["steps"], "ppo": 0}, state["warnings"]
    policy, tokenizer = load_proxy(args, accelerator.device)
    before_sft = evaluate_stage(accelerator, out, "raw", policy, tokenizer, env, test_rows, args)
    examples, solved = build_warmup(train_rows, env.llm, env, args)
    accelerator.print(f"warm-up: {dict(Counter(e['agent'] for e in examples))}; {solved:.2f} of the questions solved")
    policy, steps = sft(accelerator, policy, tokenizer, examples, args, world, out)
    warnings = []
    if not steps:  # PPO starts from the raw proxy
        why = "no successful warm-up path: check --teacher" if not examples else "--sft_steps/--sft_epochs: 0 steps"
        runs.nothing_to_train(accelerator, warnings, "sft", why)
    if accelerator.is_main_process:
        state = dict(method="c3po", world=args.world, before_sft=before_sft, steps=steps, warnings=warnings)
        runs.save_checkpoint(sft_dir, policy, tokenizer, state | dict(data_dir=args.data_dir, args=asdict(args)))
    return policy, tokenizer, before_sft, {"sft": steps, "ppo": 0}, warnings


def train(args):
    """Teacher warm-up data, SFT, PPO on tree rollouts, evaluation before and after; --resume continues sft/, ppo/."""
    start = time.time()
    accelerator, out = runs.start(args, "c3po")  # the run's folder; refuses a checkpoint without --resume
    train_rows = sample_rows(load_split(args.data_dir, "train", args.question_types), args.n_train, args.seed)
    test_rows = load_split(args.data_dir, "test", args.question_types)[: args.n_eval]
    toy.require_oracle_metadata(train_rows, args)  # the toy oracle teacher reads each question's hops (header 12)
    env, world = environment(args), toy.renaming_world(args)  # world: None, or the toy renaming's (header 14)
    policy, tokenizer, before_sft, steps, warnings = warm_up(accelerator, args, out, train_rows, test_rows, env, world)
    before = evaluate_stage(accelerator, out, "sft", policy, tokenizer, env, test_rows, args, step=0)
    # ---- PPO: policy and centralized critic with separate optimizers, reference frozen [App. A.1, Tab. 7]
    # simplification: policy, critic and reference start from the final SFT model (header 3)
    ref, value = copy.deepcopy(policy).eval().requires_grad_(False), ValueModel(policy)
    optimizers = [torch.optim.Adam(m.parameters(), lr=lr, betas=(0.9, 0.95))
                  for m, lr in ((policy, args.policy_lr), (value, args.value_lr))]  # fmt: skip
    schedule = lambda s: cosine(s, args.ppo_iterations, 1)  # one step per PPO update
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    rng = random.Random(args.seed * 1000)  # the same draws on every process: one global batch of questions
    # the unwrapped models and optimizers that accelerator.prepare wraps below: what a checkpoint saves
    objects = dict(policy=policy, value=value, optimizers=optimizers, schedulers=schedulers)
    if state := runs.load_training(accelerator, out / "ppo", objects, rng):  # --resume
        steps["ppo"] = state["iteration"]
        accelerator.print(f"resumed PPO at iteration {steps['ppo']}")
    curve = lambda rows: evaluate(objects["policy"], tokenizer, env, rows, args)  # greedy, as at inference [§6.1]
    if steps["ppo"] == 0:  # the curve's start: the SFT model
        runs.curve_point(accelerator, out, args, 0, curve)
    policy, value, *optimizers = accelerator.prepare(policy, value, *optimizers)
    pad = tokenizer.pad_token_id
    for it in range(steps["ppo"], args.ppo_iterations):
        t0 = time.time()
        rows = rng.sample(train_rows, min(args.rollout_batch, len(train_rows)))
        rows = toy.rename_rows(rows, world, rng, args.rl_augment_p)  # simplification: renamed trees (header 14)
        rows, weight = runs.own_share(rows, accelerator)  # this process's trees of the --rollout_batch
        actor = proxy_actor(accelerator.unwrap_model(policy), tokenizer, args, greedy=False)
        with accelerator.autocast():
            seed = args.seed * 100_003 + it * 7919 + accelerator.process_index
            trees = rollout(rows, actor, env, args, args.credit_mode, seed)  # tree [§5.1]; w/o tree [§6.4]
        samples = node_samples(trees, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        stats = rollout_stats(trees, samples)
        stats |= ppo_update(accelerator, policy, value, ref, optimizers, schedulers, samples, pad, args, weight)
        stats |= {"iteration": it + 1, "charts/seconds": time.time() - t0}
        runs.log_update(accelerator, out, stats, step=it + 1)
        steps["ppo"] = it + 1
        if (it + 1) % args.eval_every == 0 or it + 1 == args.ppo_iterations:
            state = dict(method="c3po", world=args.world, iteration=it + 1, data_dir=args.data_dir, args=asdict(args))
            runs.curve_point(accelerator, out, args, it + 1, curve)
            runs.save_training(accelerator, out / "ppo", objects["policy"], tokenizer, state, objects, rng)
    policy = accelerator.unwrap_model(policy)
    after = evaluate_stage(accelerator, out, "ppo", policy, tokenizer, env, test_rows, args, step=steps["ppo"])
    accelerator.end_training()
    results = runs.result_record("c3po", args, before_sft, before, after, steps, time.time() - start)
    runs.write_results(out, results | {"warnings": warnings}, accelerator.is_main_process, TABLE_ROWS)


# --------------------------------------------------------------------------- 9. evaluate, --eval, --ask [§6.1, §6.5]
def tree_record(tree, decoding):
    """A one-path (inference) tree's outcome (accuracy, EM, F1, calls, strategy, tokens, depth) and its prediction
    line: golds, prediction, the path in short (node kind: text), then the outcome."""
    nodes, row, leaf = tree["nodes"], tree["row"], next(n for n in tree["nodes"] if n["kind"] == "leaf")
    tokens = sum(len(n["action_ids"] or []) for n in nodes if n["kind"] in AGENTS)
    strategy = next((n.get("strategy", "invalid") for n in nodes if n["kind"] == "router"), "invalid")
    record = dict(accuracy=leaf["reward"], **answer_scores(leaf["answer"], row["golden_answers"]))
    record |= {k: tree[k] for k in ("retrievals", "llm_calls", "proxy_calls")} | dict(invalid=leaf["why"] != "answer")
    record |= dict(depth=leaf["depth"], strategy=strategy, generated_tokens=tokens)
    path = " | ".join(f"{n['kind']}: {node_text(n)[:200]}" for n in nodes[1:])
    line = dict(id=row.get("id"), question=row["question"], decoding=decoding, golden_answers=row["golden_answers"])
    return record, line | dict(prediction=leaf["answer"], trajectory=path, **record)


def node_text(node):
    """A node's text on one line: a leaf's answer, an agent's output or a roadmap."""
    return " ".join(str(node.get("answer") if node["kind"] == "leaf" else node["text"]).split())


@runs.evaluation
def evaluate(model, tokenizer, env, rows, args, greedy=True, seed=0, batch=256, predictions=None):
    """Alg. 1 on the rows (greedy or T = 1), batched; a list `predictions` gets each question's path and scores."""
    start, records, (mode, decoding) = time.time(), [], ("greedy", "greedy") if greedy else ("sample", "sampled")
    quiet = not PartialState().is_local_main_process
    for s in runs.progress(range(0, len(rows), batch), "eval", disable=quiet, leave=False):
        trees = rollout(rows[s : s + batch], proxy_actor(model, tokenizer, args, greedy), env, args, mode, seed + s)
        outcomes = [tree_record(t, decoding) for t in trees]
        records += [record for record, _ in outcomes]
        if predictions is not None:
            predictions += [line for _, line in outcomes]
    latency = (time.time() - start) / max(len(rows), 1)  # simplification: batched wall time per question (header 10)
    return summarize(records, rows, {"strategy": "strategies"}) | {"latency_s": latency}


def evaluate_stage(accelerator, out, stage, model, tokenizer, env, rows, args, step=None):
    """Greedy and sampled evaluations at a stage (raw, sft, ppo, eval), with predictions_<stage>.jsonl and logs."""
    kept = []
    with accelerator.autocast():
        greedy = evaluate(model, tokenizer, env, rows, args, greedy=True, predictions=kept)
        sampled = evaluate(model, tokenizer, env, rows, args, greedy=False, seed=args.seed + 10_000, predictions=kept)
    if accelerator.is_main_process:
        write_jsonl(out / f"predictions_{stage}.jsonl", kept)
    strategies = " ".join(f"{k}={v:.2f}" for k, v in greedy["strategies"].items())
    accelerator.print(f"{stage} | greedy acc={greedy['accuracy']:.3f} retrievals={greedy['retrievals']:.2f} "
                      f"[{strategies}] | sampled acc={sampled['accuracy']:.3f}")  # fmt: skip
    if step is not None:
        runs.log_eval(accelerator, out, stage, greedy | {"sampled": sampled}, step)
    return greedy | {"sampled": sampled}


def run_eval(args):
    """Evaluate --model (a checkpoint folder, or the untrained start) on the test split."""
    # a bad data file fails before the evaluation's folder is made
    start, rows = time.time(), load_split(args.data_dir, "test", args.question_types)[: args.n_eval]
    accelerator, out = runs.start_eval(args)
    accelerator.print(f"evaluation folder: {out}")
    policy, tokenizer = load_proxy(args, accelerator.device)
    result = evaluate_stage(accelerator, out, "eval", policy, tokenizer, environment(args), rows, args)
    results = runs.result_record("c3po", args, None, result, None, {"sft": 0, "ppo": 0}, time.time() - start)
    runs.write_results(out, results | {"warnings": []}, accelerator.is_main_process, TABLE_ROWS)


def ask(args):
    """One question through Algorithm 1 with the greedy proxy, printing every node."""
    policy, tokenizer = load_proxy(args, runs.make_accelerator().device)
    if unknown := unknown_words(tokenizer, args.ask):
        print(f"warning: words the proxy's tokenizer does not know (read as <unk>): {' '.join(unknown)}")
    row = {"id": "ask", "question": args.ask, "golden_answers": [""], "metadata": {}}
    tree = rollout([row], proxy_actor(policy, tokenizer, args, greedy=True), environment(args), args, "greedy")[0]
    for n in tree["nodes"][1:]:
        print(f"depth {n['depth']} {n['kind']}: {node_text(n)}" + (f" ({n['why']})" if n["kind"] == "leaf" else ""))


def main(argv=None):
    """Parse the flags, fill the preset, dispatch on the mode."""
    # --help shows each preset field's toy and paper values; another method's checkpoint is refused
    args = apply_preset(runs.parse_args(Args, argv, "the untrained proxy writes no valid action", "c3po", PRESETS))
    (runs.dry_run if args.dry_run else train if args.train else run_eval if args.eval else ask)(args)


if __name__ == "__main__":
    runs.run_main(main)  # a user's mistake (bad file, missing field) ends in one line, not a traceback
