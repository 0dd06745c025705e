# SmartRAG: Jointly Learn RAG-Related Tasks From the Environment Feedback
# ICLR 2025, arXiv:2410.18141 (equation and section tags cite this version). Docs: docs/smartrag.md
"""SmartRAG: one policy LM decides whether to retrieve, writes the search query, and answers; trained end to end.

The policy reads the state s = [question, observations] and emits an action whose first token is a tag: `[Answer]
<answer>` ends the episode, `[Search] <query>` calls a frozen retriever whose top-K snippets join the observations
(Algorithm 1, quota N, answer forced at the quota). A warm-up SFT teaches the format (Eq. 2-4; the filtered initial
policy keeps only the pairs that fit what the base model knows), then PPO optimises whole episodes against the reward
EM + F1 - alpha per retrieval (Eq. 5-6), with a value model, a frozen reference and a per-token KL penalty.

    python smartrag.py --train --run_name smartrag            # toy world, tiny model, CPU: SFT, PPO, evaluation
    python smartrag.py --eval --model runs/smartrag/ppo       # evaluate a checkpoint on the toy test split
    python smartrag.py --ask "what is the birthplace of sazebox ?" --model runs/smartrag/ppo
    accelerate launch smartrag.py --train --preset paper --data_dir data/smartrag --index indexes/e5_wiki18

Departures from the paper, both presets (each marked `# simplification: ... (header N)` where it lives):
1. The retriever is a local index over a FlashRAG corpus (top-K passages as "title: text" snippets), not Bing search.
2. Causal LMs only: the paper's main model is the seq2seq Flan-T5-large; the paper preset is its LLaMA-2-7B + LoRA.
3. PPO samples are whole actions (one sequence per action), not RL4LMs' token transitions; advantages are whitened
   per minibatch.
4. gamma discounts per token (impl, RL4LMs) where Eq. 6 discounts per step: the retrieval cost seen from the answer
   grows with the query length (about 0.27 for 4 tokens, 0.84 for 50 at gamma 0.99).
5. SFT uses AdamW betas (0.9, 0.98), a linear warm-up of min(50, steps/10) steps, linear decay to 0.1 x lr and
   gradient clipping at 1.0 (the paper states none of these).
6. The value model is a copy of the SFT policy's backbone with a zero-initialised, bias-free scalar head.
7. An empty search query searches with the question (the paper does not say what an empty query does).
8. Metrics: EM and F1 as the paper reports them (FlashRAG's definitions); `acc` (sub-EM) is logged beside them.

Toy-world adaptations, the toy preset only (PRESETS; the machinery in common/toy/smartrag.py):
9. The warm-up rewriter (GPT-3.5 in the paper) is the oracle entity + relation rewrite of the metadata (rewriter).
10. SFT retrieval pairs and not-popular PPO episodes are entity-renamed (augment_p, rl_augment_p).
11. The raw toy-lm knows nothing, so the toy base first learns the popular facts (base_pretrain_steps).
12. The knowledge probe is the toy reader, whose parametric memory is exactly the `popular` flag (base_llm).
13. Compact template, greedy decoding after the threshold, smaller PPO (templates).
14. The plain warm-up pi_0 and a fixed KL coefficient 0.1 (initial_policy, kl_init, kl_adaptive; impl: adaptive).
"""

import copy
import math
import random
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast, gather_object

from common import runs
from common.data import load_split, sample_rows, write_jsonl
from common.llm import backbone_of, chat_prompts, generate, left_pad, right_pad, unknown_words
from common.metrics import answer_scores, cover_em, f1_score, summarize
from common.models import is_toy_lm, load_model_and_tokenizer, make_llm
from common.retrieval import open_retriever
from common.runs import arg
from common.toy import smartrag as toy


@dataclass
class Args:
    preset: str = arg("toy", "toy (toy world, tiny model, CPU) or paper", choices=["toy", "paper"], group="experiment")
    train: bool = arg(False, "SFT warm-up, then PPO, then evaluation")
    eval: bool = arg(False, "evaluate --model (a checkpoint or the untrained start)")
    ask: str = arg("", "answer one question with --model and print the trajectory")
    output_dir: str | None = arg(None, "run folder (default: runs/<run_name>; --eval: <model>/eval/<data>-<time>)")
    run_name: str | None = arg(None, "a training run's name (default: smartrag__<seed>__<time>)")
    resume: bool = arg(False, "continue the run --run_name / --output_dir from its last checkpoint")
    dry_run: bool = arg(False, "print the resolved configuration, check its paths and models, load nothing")
    report_to: str = arg("none", "tracker beside metrics.jsonl", choices=["none", "tensorboard", "wandb"])
    seed: int = arg(0, "seed of models, sampling and data order")
    data_dir: str | None = arg(None, "folder with train/test jsonl (FlashRAG QA)", group="data, retriever, model")
    world: str | None = arg(None, runs.WORLD_HELP)
    corpus: str | None = arg(None, "FlashRAG corpus jsonl (default: data_dir/corpus.jsonl)")
    index: str = arg("", "saved retriever folder (python -m common.retrieval build)")
    encoder: str | None = arg(None, "tfidf, bm25 or a dense encoder (hub id or folder) when --index is empty")
    model: str | None = arg(None, "policy: hub id, local folder or toy-lm spec")
    lora_r: int | None = arg(None, "LoRA rank, 0 = full fine-tuning [App. A.3: LoRA for LLaMA]", low=0)
    gradient_checkpointing: bool | None = arg(None, "recompute activations in the backward pass (memory)")
    templates: str | None = arg(None, "paper (Tab. 7 verbatim) or compact", choices=["paper", "compact"])
    n_train: int | None = arg(None, "training questions (None: all)", low=1)
    n_eval: int | None = arg(None, "test questions evaluated (None: all)", low=1)
    question_types: str | None = arg(None, "comma-separated metadata types to keep (empty: all)", flag=False)
    quota: int = arg(1, "retrieval quota N [Alg. 1; §4: N = 1]", low=0, group="Algorithm 1 and the reward")
    top_k: int | None = arg(None, "snippets per retrieval K [App. A.3: 4]", low=1)
    alpha: float = arg(0.2, "retrieval cost alpha [Eq. 5; App. A.3: 0.2]", low=0.0)
    invalid_reward: float = arg(-1.0, "reward of an untagged action, which ends the episode (impl: -1)", flag=False)
    initial_policy: str | None = arg(
        None, "plain pi_0 (pairs 2-4) or filtered pi_0*", choices=["plain", "filtered"], group="warm-up SFT [§3.1]"
    )
    rewriter: str | None = arg(None, "warm-up queries: oracle (toy metadata) or an LLM spec [App. A.2: gpt-3.5]")
    rewriter_model: str = arg("", "model name when --rewriter is an endpoint URL")
    base_llm: str | None = arg(None, "LLM spec of the base model's knowledge probe (an endpoint serves --model)")
    know_f1: float = arg(0.2, "the base model 'knows' x if its direct-answer F1 >= this [App. A.2: 0.2]", flag=False)
    probe_tokens: int = arg(32, "tokens of the knowledge probe's reply (ours: 32; more for <think>)", flag=False)
    base_pretrain_steps: int | None = arg(None, "steps teaching the raw toy base model the popular facts", flag=False)
    sft_steps: int | None = arg(None, "SFT steps (0: one epoch [§4: 1 epoch])", low=0)
    sft_lr: float | None = arg(None, "SFT learning rate [§4: 3e-4]", low=0.0)
    sft_batch_size: int | None = arg(None, "SFT batch size, all processes together [§4: 8]", low=1)
    micro_batch_size: int | None = arg(None, "rows per forward/backward pass (memory only: the same gradient)", low=1)
    augment_p: float | None = arg(None, "entity-renaming probability of a retrieval pair", flag=False)
    rl_augment_p: float | None = arg(None, "renaming probability of a not-popular PPO episode", flag=False)
    ppo_iterations: int | None = arg(None, "PPO iterations (impl: 100 for T5-large)", low=0, group="PPO [§3.2, §4]")
    rollout_tokens: int | None = arg(None, "generated tokens per iteration, all processes together [§4: 5120]", low=0)
    rollout_batch: int | None = arg(None, "questions per batched rollout, shared out over the processes", low=1)
    ppo_epochs: int | None = arg(None, "epochs over each rollout [§4: 1]", low=1)
    ppo_lr: float | None = arg(None, "PPO learning rate [§4: 2e-6]", low=0.0)
    ppo_batch_size: int | None = arg(None, "sequences per PPO minibatch, all processes together [§4: 32]", low=1)
    gamma: float = arg(0.99, "discount [Eq. 6] (impl: 0.99 per token)", low=0.0, high=1.0)
    lam: float = arg(0.95, "GAE lambda (impl: 0.95)", flag=False)
    clip: float = arg(0.2, "PPO clip epsilon (impl: 0.2)", flag=False)
    vf_coef: float = arg(0.5, "value loss coefficient (impl: 0.5)", flag=False)
    max_grad_norm: float = arg(0.5, "PPO gradient clipping (impl: 0.5)", flag=False)
    kl_init: float | None = arg(None, "initial KL coefficient beta (impl: 0.001)", low=0.0)
    kl_target: float = arg(0.2, "target KL of the adaptive controller (impl: 0.2)", flag=False)
    kl_adaptive: bool | None = arg(None, "adapt beta to kl_target after each rollout (impl); False: fixed", flag=False)
    sample_top_k: int = arg(50, "top-k sampling in rollouts [App. A.3: 50]", low=1)
    max_new_tokens: int | None = arg(None, "tokens per action (impl: 50)", low=1)
    threshold: float = arg(0.5, "retrieve iff p([Search]) > this", low=0.0, high=1.0, group="inference [§4.1]")
    num_beams: int | None = arg(None, "beams after the first token (impl: 4)", low=1)
    eval_every: int = arg(25, "checkpoint every this many PPO iterations", low=1)


PRESETS = {  # field: (toy, paper), for the fields left at None; any flag overrides them
    "data_dir": ("data/toy", "data/smartrag"),
    "encoder": ("tfidf", "intfloat/e5-base-v2"),  # simplification: a local index, not Bing (header 1)
    "model": ("toy-lm", "meta-llama/Llama-2-7b-chat-hf"),  # [§4] (header 2)
    "lora_r": (0, 16),  # LoRA [App. A.3]; the rank is ours (the paper gives none)
    "gradient_checkpointing": (False, True),  # a 7B policy, value model and reference on one 80 GB GPU
    "templates": ("compact", "paper"),  # simplification: header 13
    "question_types": ("", ""),  # every type: the paper's mix holds HotpotQA [§4]
    "top_k": (1, 4),  # [App. A.3]
    "rewriter": ("oracle", ""),  # simplification: header 9; paper: --rewriter <an LLM spec for gpt-3.5>
    "base_llm": ("toy", "hf:meta-llama/Llama-2-7b-chat-hf"),  # simplification: header 12
    "base_pretrain_steps": (300, 0),  # toy: the raw toy-lm first learns the popular facts (header 11)
    "initial_policy": ("plain", "filtered"),  # [§3.1]; simplification: header 14
    "sft_steps": (1200, 0),  # [§4: 1 epoch]
    "sft_lr": (2e-3, 3e-4),  # [§4]
    "sft_batch_size": (64, 8),  # [§4]
    "micro_batch_size": (64, 8),  # ours: memory only (any value, the same gradient)
    "augment_p": (1.0, 0.0),  # toy: non-popular facts copied from observations, never memorised (header 10)
    "rl_augment_p": (1.0, 0.0),  # toy: the same for PPO's not-popular episodes (header 10)
    "ppo_iterations": (100, 50),
    "rollout_tokens": (0, 5120),  # [§4]
    "rollout_batch": (128, 64),
    "ppo_epochs": (2, 1),  # [§4]
    "ppo_lr": (1e-4, 2e-6),  # [§4]
    "ppo_batch_size": (64, 32),  # [§4]
    "kl_init": (0.1, 0.001),  # impl: 0.001, adaptive
    "kl_adaptive": (False, True),  # toy: a fixed beta (header 14); paper: the authors' adaptive controller
    "max_new_tokens": (8, 50),  # impl
    "num_beams": (1, 4),  # impl
}


def apply_preset(args):
    """Fill the fields left at None from the preset's column; a combination that cannot run is one line naming every
    problem at once."""
    for key, values in PRESETS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[args.preset == "paper"])
    args.corpus = args.corpus or str(Path(args.data_dir) / "corpus.jsonl")
    args.world = args.world or runs.toy_world(None, args.data_dir)  # parse_args's, or the data's (Args built in code)
    problems = ["choose one mode of --train, --eval, --ask"] * (args.train + args.eval + bool(args.ask) > 1)
    problems += ["--resume continues a training run: only with --train"] * (args.resume and not args.train)
    if is_toy_lm(args.model) and not args.world:
        problems.append(f"--model {args.model} takes its vocabulary from a toy world: pass --world DIR (world.json)")
    if args.base_llm == "toy" and args.world:  # the toy reader of the world being trained on, never data/toy
        args.base_llm = f"toy:{args.world}"
    elif args.base_llm == "toy" and args.train and args.initial_policy == "filtered":
        problems.append("--base_llm toy (the knowledge probe of --initial_policy filtered) needs --world DIR")
    if args.preset == "paper" and not args.rewriter and args.train:
        problems.append("--preset paper --train needs --rewriter: an LLM spec (e.g. an OpenAI-compatible URL for "
                        "gpt-3.5-turbo-1106 and --rewriter_model) writes the warm-up queries [App. A.2]")  # fmt: skip
    if problems:
        raise SystemExit("; ".join(problems))
    if args.output_dir is None and args.eval:  # a new folder per evaluation, never over an earlier one
        args.output_dir = runs.eval_dir(args, "smartrag")
    return args


# --------------------------------------------------------------------------- 1. templates and parsing [App. A.3]
ANSWER_TAG, RETRIEVE_TAG = "[Answer]", "[Search]"  # the paper writes [ANSWER]/[RETRIEVE]; Table 7 and the code these
TEMPLATES = {  # (without observations, with observations) [Tab. 7]
    "paper": (
        """\
You will be presented with a question. If you know the answer, please respond directly. If you don't know the \
answer, use the Bing search engine to find the necessary information and then answer the question based on your \
observation.

Question: {input}

Please format your output as follows:

1. If you choose to answer the question directly, please use: '[Answer] YOUR_ANSWER'
2. If you choose to use the Bing search engine, please use:
'[Search] YOUR_SEARCH_QUERY'

Please output:""",
        """\
You will be presented with a question. If you know the answer, please respond directly. If you don't know the \
answer, use the Bing search engine to find the necessary information and then answer the question based on your \
observation.

Question: {input}

Observation: {search}

Please format your output as follows:

1. If you choose to answer the question directly, please use: '[Answer] YOUR_ANSWER'
2. If you choose to use the Bing search engine, please use:

'[Search] YOUR_SEARCH_QUERY'

Please output:""",
    ),
    # simplification: the toy preset's compact form with the same fields (header 13)
    "compact": ("question : {input} output :", "question : {input} observation : {search} output :"),
}
# [App. A.2] verbatim: the warm-up rewriter's prompt
REWRITE_PROMPT = """\
Assuming you are a professional retrieval model, rewrite the following question into a query that is more suitable \
for retrieval: {question}"""


def render_state(question, observations, templates):
    """The prompt of state s = [x, os] [Eq. 1]: template 1 without observations, template 2 with them joined."""
    without, with_obs = TEMPLATES[templates]
    if not observations:
        return without.format(input=question)
    return with_obs.format(input=question, search=" ".join(observations))  # os: every observation, joined [Eq. 1]


def format_observation(hits):
    """Top-K passages as one observation: "title: text" snippets joined by spaces [App. A.3]."""
    return " ".join(f"{h['title']}: {h['text']}" for h in hits)


def parse_action(ids, tag_ids, tokenizer):
    """(kind, text) of an action's token ids: kind is answer / retrieve by its first token, else invalid [§3]."""
    if not ids or ids[0] not in tag_ids.values():
        return "invalid", ""
    kind = "answer" if ids[0] == tag_ids["answer"] else "retrieve"
    return kind, tokenizer.decode(ids[1:], skip_special_tokens=True).strip()


# --------------------------------------------------------------------------- 2. rewards [Eq. 5, Eq. 6]
def step_reward(kind, text, golds, alpha, invalid_reward):
    """r(t) = EM + F1 for an answer, -alpha for a retrieval [Eq. 5]; an untagged action gets invalid_reward (impl)."""
    if kind == "answer":
        scores = answer_scores(text, golds)
        return scores["em"] + scores["f1"]
    return -alpha if kind == "retrieve" else invalid_reward


def discounted_return(rewards, gamma):
    """sum_t gamma^t r(t) over the steps of a trajectory [Eq. 6]."""
    return sum(gamma**t * r for t, r in enumerate(rewards))


# --------------------------------------------------------------------------- 3. warm-up data [§3.1, Eq. 2-4]
def knows_answer(prediction, golds, know_f1):
    """The base model 'knows' x when its direct answer has F1 >= 0.2 against the golds [App. A.2]."""
    return f1_score(prediction, golds) >= know_f1 - 1e-9  # 0.2 is not exact in floating point


def warmup_examples(row, query, observation, knows, initial_policy):
    """The SFT pairs of one question as text fields: (2) direct answer, (3) retrieve + query, (4) answer with obs."""
    tags = toy.renaming_tags(row)  # read only by the toy world's renaming augmentation (header 10)
    answer = row["golden_answers"][0]  # ours: the first alias (the paper has one y)
    direct = dict(question=row["question"], observations=[], tag="answer", text=answer, **tags)  # [Eq. 2]
    search = dict(question=row["question"], observations=[], tag="retrieve", text=query, **tags)  # [Eq. 3]
    read = dict(question=row["question"], observations=[observation], tag="answer", text=answer, **tags)  # [Eq. 4]
    if initial_policy == "plain":  # pi_theta_0: all three pairs, so (2) and (3) share one input [§3.1]
        return [direct, search, read]
    return [direct] if knows else [search, read]  # pi_theta_0*: keep what fits the base model's knowledge [§3.1]


def rewrite_queries(rows, args):
    """Warm-up queries: the paper's GPT-3.5 rewrite prompt on any LLM backend, or the toy world's oracle rewrite."""
    if args.rewriter == "oracle":  # simplification: the entity + relation of hop 1 (header 9)
        return toy.oracle_rewrite(rows)
    llm = make_llm(args.rewriter, world=args.world, **({"model": args.rewriter_model} if args.rewriter_model else {}))
    prompts = [[{"role": "user", "content": REWRITE_PROMPT.format(question=r["question"])}] for r in rows]
    replies = llm.chat(prompts, temperature=0.0, max_tokens=64)
    return [THINK.sub("", q).strip() or r["question"] for q, r in zip(replies, rows)]


THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)  # a reasoning model's block, or one cut before it closed


def direct_answer(reply):
    """The answer of a knowledge-probe reply: what follows its <think> block and the [Answer] tag a chat model given
    Table 7's direct template writes (words before the tag dropped); a [Search] reply answers nothing."""
    text = THINK.sub("", reply)
    tagged = re.split(r"\[answer\]", text, maxsplit=1, flags=re.I)
    if len(tagged) == 2:
        return tagged[1].strip()
    return "" if re.search(r"\[(search|retrieve)\]", text, flags=re.I) else text.strip()


def probe_knowledge(rows, args):
    """Which training questions the base model answers directly (F1 >= know_f1), asked with the direct template."""
    served = {"model": args.model} if str(args.base_llm).startswith(("http://", "https://")) else {}  # the base model
    llm = make_llm(args.base_llm, **served)  # simplification: the toy reader in the toy world (header 12)
    prompts = [[{"role": "user", "content": render_state(r["question"], [], args.templates)}] for r in rows]
    replies = llm.chat(prompts, temperature=0.0, max_tokens=args.probe_tokens)
    if cut := sum("<think>" in reply and "</think>" not in reply for reply in replies):
        print(f"warning: {cut} of {len(replies)} knowledge-probe replies ended inside <think> (--probe_tokens "
              f"{args.probe_tokens}): read as not known")  # fmt: skip
    return [knows_answer(direct_answer(reply), r["golden_answers"], args.know_f1) for reply, r in zip(replies, rows)]


def warmup_inputs(rows, env, args):
    """(rewritten query, its observation, whether the base model knows x) of each question."""
    if not rows:
        return []
    queries = rewrite_queries(rows, args)
    observations = [format_observation(h) for h in env.search(queries, args.top_k, rows)]
    knows = probe_knowledge(rows, args) if args.initial_policy == "filtered" else [False] * len(rows)
    return list(zip(queries, observations, knows))


def build_warmup(rows, env, args):
    """All SFT examples of the training questions (retrieval with the rewritten query, as Eq. 4 says); the rewrites,
    retrievals and knowledge probes shared out over the run's processes (runs.map_shared), each done once."""
    inputs = runs.map_shared(lambda part: warmup_inputs(part, env, args), rows)
    examples = [e for row, (q, o, k) in zip(rows, inputs)
                for e in warmup_examples(row, q, o, k, args.initial_policy)]  # fmt: skip
    return examples, sum(k for _, _, k in inputs) / max(len(rows), 1)


# --------------------------------------------------------------------------- 4. the policy and the value model
class PolicyAndValue(torch.nn.Module):
    """The policy LM and a value model (a copy of its backbone, no LM head, and a scalar head), for one prepare()."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.value_backbone = backbone_of(copy.deepcopy(policy))  # impl: a separate copy of the SFT model
        self.value_head = torch.nn.Linear(policy.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.value_head.weight)  # simplification: a zero-initialised head (header 6)

    def forward(self, input_ids, attention_mask):
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
        hidden = self.value_backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return logits, self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # (B, T)


def add_tags(model, tokenizer):
    """Register [Answer] and [Search] as single tokens and return their ids [§3] (impl: special tokens)."""
    tags = {"answer": ANSWER_TAG, "retrieve": RETRIEVE_TAG}
    if new := [t for t in tags.values() if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]:
        tokenizer.add_tokens(new, special_tokens=True)
        model.resize_token_embeddings(len(tokenizer))
    return {kind: tokenizer.convert_tokens_to_ids(tag) for kind, tag in tags.items()}


def load_policy(args, device):
    """The policy LM and tokenizer, with the two tags (and LoRA adapters when lora_r > 0)."""
    # fp32 master weights, bf16 autocast (accelerate mixed precision); only a frozen LoRA base may be stored in bf16
    dtype = torch.bfloat16 if device.type == "cuda" and args.lora_r else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, world=args.world)
    tag_ids = add_tags(model, tokenizer)
    if args.lora_r and not hasattr(model, "peft_config"):
        from common.llm import add_lora

        targets, tags = ["q_proj", "k_proj", "v_proj", "o_proj"], sorted(tag_ids.values())  # tags' rows: trained
        if not model.config.tie_word_embeddings:  # an untied LM head (Llama-2): its tag rows are trained and saved too
            name_of = {module: name for name, module in model.named_modules()}
            tags = {name_of[model.get_input_embeddings()]: tags, name_of[model.get_output_embeddings()]: tags}
        lora = dict(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05, target_modules=targets)
        model = add_lora(model, lora | dict(trainable_token_indices=tags))
    for p in model.parameters():  # never Adam on bf16 weights: every trained parameter is fp32
        if p.requires_grad:
            p.data = p.data.float()
    if args.gradient_checkpointing:  # only in train mode; rollouts run in eval mode with the KV cache
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device), tokenizer, tag_ids


def encode_states(tokenizer, states):
    """Token ids of rendered states, through the chat template when the tokenizer has one."""
    messages = [[{"role": "user", "content": s}] for s in states]
    texts = chat_prompts(tokenizer, messages) if tokenizer.chat_template else states
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def first_token_probs(model, prompts, pad_id):
    """p(next token) at the end of each prompt, (B, V), for the retrieval threshold [§4.1]."""
    ids, mask = (t.to(model.device) for t in left_pad(prompts, pad_id))  # (B, T) each
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float().softmax(-1)


# --------------------------------------------------------------------------- 5. rollout [Alg. 1], batched per turn
def first_tokens(model, tokenizer, prompts, n, args, tag_ids, greedy):
    """The decided first token a_0 of each live episode's action at retrieve count n, as a prefix (empty: sampled
    with the rest): [Answer] at the quota [Alg. 1 L3-4]; when decoding greedily, [Search] iff p([Search]) > threshold
    [§4.1, App. A.3]; when sampling, none [App. A.3]."""
    if n == args.quota:  # [Alg. 1 L3-4] the quota is met: force a_0 = [ANSWER]
        return [[tag_ids["answer"]] for _ in prompts]
    if not greedy:  # [App. A.3] top-k sampling, the first token sampled freely
        return [[] for _ in prompts]
    p_retrieve = first_token_probs(model, prompts, tokenizer.pad_token_id)[:, tag_ids["retrieve"]]
    return [[tag_ids["retrieve"] if p > args.threshold else tag_ids["answer"]] for p in p_retrieve.tolist()]


def act(model, tokenizer, live, n, args, tag_ids, greedy, seed):
    """a ~ pi_theta([x, os]) for every live episode in one generate call [Alg. 1 L3-6], parsed by its first token
    and rewarded [Eq. 5]; an answer or an invalid action ends the episode [Alg. 1 L8-10]. The [Answer] forced at the
    quota is part of the state (forced_ids), not of the action; a tag decided by the threshold is the policy's own."""
    states = [render_state(e["row"]["question"], e["observations"], args.templates) for e in live]
    prompts = encode_states(tokenizer, states)
    prefixes = first_tokens(model, tokenizer, prompts, n, args, tag_ids, greedy)
    beams, forced = args.num_beams if greedy else 1, n == args.quota
    gen = generate(model, tokenizer, [p + f for p, f in zip(prompts, prefixes)], args.max_new_tokens,
                   do_sample=not greedy, top_k=args.sample_top_k, num_beams=beams, seed=seed + n)  # fmt: skip
    for e, prompt, prefix, ids in zip(live, prompts, prefixes, gen.token_ids):
        action = prefix + ids
        kind, text = parse_action(action, tag_ids, tokenizer)
        reward = step_reward(kind, text, e["row"]["golden_answers"], args.alpha, args.invalid_reward)
        turn = dict(prompt_ids=prompt, forced_ids=prefix if forced else [], action_ids=ids if forced else action)
        e["turns"].append(turn | dict(kind=kind, text=text, reward=reward))
        e["done"] = kind != "retrieve"  # [Alg. 1 L8-10] an answer (or an invalid action) ends the episode
        e["answer"] = text if kind == "answer" else e["answer"]


def observe(env, searching, args):
    """o = R(a_1:), os = [os, o] for every episode whose action retrieved [Alg. 1 L9]: one retriever call."""
    # simplification: an empty query searches with the question (header 7)
    queries = [e["turns"][-1]["text"] or e["row"]["question"] for e in searching]
    for e, hits in zip(searching, env.search(queries, args.top_k, [e["row"] for e in searching])):
        e["observations"].append(format_observation(hits))


def rollout(model, tokenizer, env, rows, args, tag_ids, greedy, seed):
    """Algorithm 1 for a batch of questions, turn by turn over the live episodes. One episode per row: {"row",
    "turns": [{prompt_ids, forced_ids, action_ids, kind, text, reward}], "observations", "answer"}."""
    episodes = [{"row": r, "turns": [], "observations": [], "answer": "", "done": False} for r in rows]
    for n in range(args.quota + 1):  # [Alg. 1 L2] while n <= N
        live = [e for e in episodes if not e["done"]]
        if not live:
            break
        act(model, tokenizer, live, n, args, tag_ids, greedy, seed)
        observe(env, [e for e in live if not e["done"]], args)
    return episodes


# --------------------------------------------------------------------------- 6. PPO [§3.2]
def gae(rewards, values, gamma, lam):
    """Advantages and returns over one episode's action tokens, concatenated across actions (done only at the end)."""
    # simplification: gamma per token, not per step as in Eq. 6 (header 4)
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0  # across the action boundary: V of the next state
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def update_kl_coef(beta, kl_mean, target):
    """Adaptive KL controller (impl, RL4LMs): beta * (1 + 0.1 * clip((KL - target) / target, -0.2, 0.2))."""
    return beta * (1 + 0.1 * min(max((kl_mean - target) / target, -0.2), 0.2))


def ppo_losses(new_logp, old_logp, advantages, values, returns, mask, clip, n=None):
    """Clipped surrogate and value MSE summed over the action tokens (mask) and divided by n, by default their count:
    the means over the tokens [PPO, Schulman et al. 2017]."""
    ratio = torch.exp(new_logp - old_logp)  # (B, T)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))  # (B, T)
    n = mask.sum().clamp(min=1) if n is None else n
    return (pg * mask).sum() / n, (((values - returns) ** 2) * mask).sum() / n, ratio


def sequences_of(episodes):
    """One training sequence per action: ids = prompt + forced + action, loss_mask = 1 exactly on action tokens."""
    seqs = []
    for i, e in enumerate(episodes):
        for t in e["turns"]:
            ids = t["prompt_ids"] + t["forced_ids"] + t["action_ids"]
            loss_mask = [0] * (len(t["prompt_ids"]) + len(t["forced_ids"])) + [1] * len(t["action_ids"])
            seqs.append(dict(episode=i, ids=ids, loss_mask=loss_mask, reward=t["reward"]))
    return seqs


def forward_logp_values(model, seqs, pad_id, device, with_values=True):
    """Per-token log-probs of the next token and values at the state before it, shifted: (B, T-1) each."""
    ids = right_pad([s["ids"] for s in seqs], pad_id).to(device)  # (B, T)
    attention = right_pad([[1] * len(s["ids"]) for s in seqs], 0).to(device)  # (B, T)
    if with_values:
        logits, values = model(ids, attention)
    else:
        logits, values = model(input_ids=ids, attention_mask=attention).logits, None
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return logp, (values[:, :-1].float() if values is not None else None)


def score_rollout(seqs, logp, ref_logp, values, mask, beta, args):
    """Per-token rewards (-beta * KL, plus the env reward on each action's last token), then GAE per episode."""
    kl = (logp - ref_logp) * mask  # (B, T-1) k1 estimate, in the reward (impl)
    rewards = -beta * kl
    last = mask.cumsum(-1).argmax(-1)  # (B,) index of each sequence's last action token
    rewards[torch.arange(len(seqs)), last] += torch.tensor([s["reward"] for s in seqs], device=rewards.device)
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    by_episode = defaultdict(list)
    for row, s in enumerate(seqs):
        by_episode[s["episode"]].append(row)
    for rows in by_episode.values():  # one GAE over all actions of the episode (impl)
        cols = [mask[r].nonzero().squeeze(-1) for r in rows]
        along = lambda x: torch.cat([x[r, c] for r, c in zip(rows, cols)]).tolist()  # the episode's action tokens
        adv, ret = gae(along(rewards), along(values), args.gamma, args.lam)
        start = 0
        for r, c in zip(rows, cols):
            advantages[r, c] = torch.tensor(adv[start : start + len(c)], device=rewards.device)
            returns[r, c] = torch.tensor(ret[start : start + len(c)], device=rewards.device)
            start += len(c)
    return advantages, returns, (kl.sum() / mask.sum().clamp(min=1)).item()


@torch.no_grad()
def score_sequences(accelerator, model, ref, seqs, pad, chunk):
    """Each sequence with the behaviour policy's log-probs and values and the reference's log-probs at its states
    (lists of len(ids) - 1): in eval mode (no dropout) and under autocast, as in the rollout; chunk sequences at a time
    (the (B, T, V) logits of a whole rollout need not fit at once)."""
    model.eval()
    for i in range(0, len(seqs), chunk):
        part = seqs[i : i + chunk]
        with accelerator.autocast():  # the reference too: a bf16 policy and an fp32 reference would differ at init
            logp, values = forward_logp_values(model, part, pad, accelerator.device)
            ref_logp = forward_logp_values(ref, part, pad, accelerator.device, with_values=False)[0]
        for s, old, reference, value in zip(part, logp.tolist(), ref_logp.tolist(), values.tolist()):
            n = len(s["ids"]) - 1
            s |= dict(logp=old[:n], ref_logp=reference[:n], values=value[:n])
    return seqs


def ppo_iteration(accelerator, model, ref, optimizer, tokenizer, episodes, beta, args):
    """One PPO update on a rollout: each process scores its own episodes, then every process holds the whole rollout
    and takes its share of each minibatch of ppo_batch_size sequences: any process count and micro-batch size give the
    update of one process on the whole rollout (and one KL for the adaptive beta). Returns logged stats."""
    mine, pad, device = sequences_of(episodes), tokenizer.pad_token_id, accelerator.device
    for s in mine:  # an episode's sequences, told apart from other processes' episodes
        s["episode"] = (accelerator.process_index, s["episode"])
    mine = score_sequences(accelerator, model, ref, mine, pad, args.ppo_batch_size)
    seqs = [s for part in gather_object([mine]) for s in part]  # every process's rollout, in process order
    old_logp, ref_logp, old_values = (
        right_pad([s[k] for s in seqs], 0.0).to(device) for k in ("logp", "ref_logp", "values")
    )
    mask = right_pad([s["loss_mask"] for s in seqs], 0).to(device)[:, 1:].float()  # (B, T-1) shifted with the labels
    advantages, returns, kl_mean = score_rollout(seqs, old_logp, ref_logp, old_values, mask, beta, args)
    model.train()  # gradient checkpointing acts in train mode only
    for module in model.modules():  # but no dropout (LoRA's): the ratio is 1 at the behaviour policy
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    stats = defaultdict(list)
    for _ in range(args.ppo_epochs):
        order = broadcast(torch.randperm(len(seqs)).to(device)).cpu()  # process 0's shuffle, for every process
        for batch in order.tensor_split(math.ceil(len(seqs) / args.ppo_batch_size)):
            scores = ppo_minibatch(accelerator, model, optimizer, seqs, batch, pad, args, old_logp, advantages,
                                   returns, mask)  # fmt: skip
            for key, x in scores.items():
                stats[f"losses/{key}"].append(x)
    ret, val = returns[mask.bool()], old_values[mask.bool()]
    stats["losses/explained_variance"] = [(1 - (ret - val).var() / ret.var().clamp(min=1e-8)).item()]
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    trained = (mask.sum() / right_pad([[1] * len(s["ids"]) for s in seqs], 0).sum()).item()
    return out | {"rollout/kl": kl_mean, "rollout/frac_trained_tokens": trained}


def ppo_minibatch(accelerator, model, optimizer, seqs, batch, pad, args, old_logp, advantages, returns, mask):
    """One optimizer step on the minibatch `batch` (indices into the whole rollout): advantages whitened over all its
    action tokens, this process's share (runs.own_share) in micro-batches, each loss summed over the share's tokens
    and divided by the minibatch's token count. Returns the minibatch's losses, clipfrac and approx KL."""
    m, a = mask[batch], advantages[batch]
    n = m.sum().clamp(min=1)  # the action tokens of the whole minibatch, every process's
    mean = (a * m).sum() / n
    a = (a - mean) / ((((a - mean) ** 2 * m).sum() / n).sqrt() + 1e-8)  # simplification: header 3
    rows, weight = runs.own_share(list(range(len(batch))), accelerator)
    scale, sums = accelerator.num_processes * weight, []  # DDP averages over processes; weight 0: a stand-in row

    def loss_of(part):
        own, index = torch.tensor(rows[part]), batch[rows[part]]
        logp, values = forward_logp_values(model, [seqs[i] for i in index.tolist()], pad, accelerator.device)
        t = slice(0, logp.shape[1])
        own_mask, log_ratio = m[own, t], (logp - old_logp[index, t]).detach()
        pg, vf, ratio = ppo_losses(
            logp, old_logp[index, t], a[own, t], values, returns[index, t], own_mask, args.clip, n
        )
        clipped = ((ratio - 1).abs() > args.clip).float()
        approx_kl = (log_ratio.exp() - 1) - log_ratio  # k3
        sums.append(torch.stack([pg, vf, (clipped * own_mask).sum() / n, (approx_kl * own_mask).sum() / n]).detach())
        return (pg + args.vf_coef * vf) * scale

    optimizer.zero_grad()
    runs.micro_backward(accelerator, model, len(rows), args.micro_batch_size, loss_of)
    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    total = runs.global_sum(accelerator, sum(sums) * weight).tolist()
    return dict(zip(("policy", "value", "clipfrac", "approx_kl"), total))


# --------------------------------------------------------------------------- 7. SFT warm-up [§3.1, §4]
def sft_batch(examples, tokenizer, tag_ids, args, rng, world):
    """Tokenised (ids, labels, attention) of a batch, loss on the target only; toy retrieval pairs renamed."""
    seqs = []
    for ex in examples:
        texts = [ex["question"], *ex["observations"], ex["text"]]
        texts = toy.rename_pair(texts, ex, world, rng, args.augment_p)  # simplification: header 10
        prompt = encode_states(tokenizer, [render_state(texts[0], texts[1:-1], args.templates)])[0]
        tag = [tag_ids[ex["tag"]]] if ex["tag"] else []  # no tag: the toy base model's pretraining (header 11)
        target = tag + tokenizer(" " + texts[-1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append((prompt + target, [-100] * len(prompt) + target))
    ids = right_pad([s[0] for s in seqs], tokenizer.pad_token_id)
    return ids, right_pad([s[1] for s in seqs], -100), right_pad([[1] * len(s[0]) for s in seqs], 0)


def sft(accelerator, out, model, tokenizer, tag_ids, examples, args, world, steps=None, name="sft"):
    """Cross-entropy on the targets of the warm-up pairs, a mean over the batch's target tokens (of every process);
    AdamW, linear decay [§4: 1 epoch, lr 3e-4, batch 8]. The mean loss of every 100 steps is logged as <name>/loss."""
    rng = random.Random(args.seed)
    steps = steps or args.sft_steps or math.ceil(len(examples) / args.sft_batch_size)  # [§4: 1 epoch]
    # simplification: betas, warm-up, decay floor and clipping are ours (header 5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.98))
    warmup = min(50, steps // 10)
    schedule = lambda s: min(1.0, (s + 1) / max(warmup, 1)) * max(0.1, 1 - s / steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()  # dropout and gradient checkpointing act in train mode only
    order, losses = [], []
    for step in range(steps):
        if len(order) < args.sft_batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = order[: args.sft_batch_size], order[args.sft_batch_size :]
        # the whole batch on every process (the same random draws everywhere), then this process's rows
        tensors = sft_batch([examples[i] for i in batch], tokenizer, tag_ids, args, rng, world)
        rows, weight = runs.own_share(list(range(len(batch))), accelerator)
        ids, labels, attention = (t[rows] for t in tensors)
        loss = runs.sft_step(accelerator, model, optimizer, scheduler, ids, labels, attention, args.micro_batch_size,
                             weight=weight)  # fmt: skip
        losses.append(loss)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            recent = losses[-((step % 100) + 1) :]  # the steps since the last line
            runs.log_update(
                accelerator, out, {f"{name}/step": step + 1, f"{name}/loss": sum(recent) / len(recent)}, step + 1
            )
    return accelerator.unwrap_model(model), steps


# --------------------------------------------------------------------------- 8. train: warm-up, PPO, evaluation
# the end-of-run table: the paper's EM and F1 [Tab. 1] and its retrieval rate [§4.2], the reward and the costs
TABLE_ROWS = ("em", "f1", "acc", "reward", "retrieval_rate", "retrievals", "policy_calls", "generated_tokens")
UNTRAINED = "--model toy-lm, the untrained start, answers at random"


def environment(args):
    """The frozen retriever, seen through each renamed episode's names (header 10; other episodes unchanged)."""
    return toy.RenamingEnv(open_retriever(args.index, args.corpus, args.encoder))


def warm_up(accelerator, args, out, train_rows, test_rows, env, world, warnings):
    """The policy after the warm-up SFT [§3.1], trained now or loaded from the run's sft/ checkpoint (--resume)."""
    sft_dir = out / "sft"
    if (state := runs.load_state(sft_dir)) is not None:
        policy, tokenizer, tag_ids = load_policy(replace(args, model=str(sft_dir)), accelerator.device)
        warnings += state.get("warnings", [])
        return policy, tokenizer, tag_ids, state["before_sft"], state["steps"]
    policy, tokenizer, tag_ids = load_policy(args, accelerator.device)
    if args.base_pretrain_steps:  # simplification: a toy base model that knows the popular facts (header 11)
        base_sft = lambda pairs, n: sft(accelerator, out, policy, tokenizer, tag_ids, pairs, args, None, n, "base")[0]
        policy = toy.pretrain_base(policy, train_rows, args.base_pretrain_steps, base_sft, accelerator, warnings)
    before_sft = evaluate_stage(accelerator, out, "raw", policy, tokenizer, env, test_rows, args, tag_ids)
    examples, known = build_warmup(train_rows, env, args)
    accelerator.print(f"warm-up: {len(examples)} pairs ({args.initial_policy}; the base model knows {known:.2f})")
    policy, steps = sft(accelerator, out, policy, tokenizer, tag_ids, examples, args, world)
    if accelerator.is_main_process:
        state = dict(before_sft=before_sft, steps=steps, warnings=warnings, **checkpoint_record(args))
        runs.save_checkpoint(sft_dir, policy, tokenizer, state)
    return policy, tokenizer, tag_ids, before_sft, steps


def rollout_seed(args, iteration, slot):
    """The sampling seed of a PPO rollout batch (rollout samples turn n with seed + n); slot: the batch's number in
    the iteration, one per round and process. Different slots, iterations and turns never share a seed."""
    return args.seed * 100_003 + iteration * 97 + 10_000_019 * slot


def checkpoint_record(args):
    """What every checkpoint records besides its stage's state: its method, data, toy world and arguments."""
    absolute = lambda path: path and str(Path(path).resolve())  # --eval from any folder finds them
    return dict(method="smartrag", data_dir=absolute(args.data_dir), world=absolute(args.world), args=asdict(args))


def collect_rollout(accelerator, model, tokenizer, env, rows, args, tag_ids, rng, world, iteration):
    """One iteration's sampled episodes [§4: 5120 generated tokens per iteration, all processes together]: batches
    of rollout_batch questions drawn with the rng every process shares, each process rolling out its share, until the
    token budget is met. Returns this process's episodes and the tokens all processes generated."""
    episodes, tokens, rounds = [], 0, 0
    policy = accelerator.unwrap_model(model).policy
    model.eval()  # rollouts without dropout and with the KV cache; ppo_iteration switches to train mode
    while not rounds or tokens < args.rollout_tokens:
        batch = rng.sample(rows, min(args.rollout_batch, len(rows)))
        batch = toy.rename_rows(batch, world, rng, args.rl_augment_p)  # simplification: header 10
        own = batch[accelerator.process_index :: accelerator.num_processes]
        seed = rollout_seed(args, iteration, rounds * accelerator.num_processes + accelerator.process_index)
        with accelerator.autocast():
            episodes += rollout(policy, tokenizer, env, own, args, tag_ids, greedy=False, seed=seed)
        tokens = runs.global_sum(accelerator, sum(len(t["action_ids"]) for e in episodes for t in e["turns"]))
        rounds += 1
    return episodes, tokens


def rollout_stats(accelerator, episodes, tokens):
    """The logged figures of an iteration's rollout: means over the episodes of every process."""
    returns = [discounted_return([t["reward"] for t in e["turns"]], 1.0) for e in episodes]
    retrieved = [float(any(t["kind"] == "retrieve" for t in e["turns"])) for e in episodes]
    total_return, total_retrieved, n = runs.global_sum(accelerator, [sum(returns), sum(retrieved), len(episodes)])
    return {"rollout/return": total_return.item() / max(n.item(), 1),
            "rollout/retrieval_rate": total_retrieved.item() / max(n.item(), 1), "rollout/tokens": int(tokens),
            "rollout/episodes": int(n)}  # fmt: skip


def save_ppo(accelerator, folder, model, optimizer, tokenizer, beta, iteration, args, rng):
    """The PPO checkpoint: the trained weights (never a frozen LoRA base), the optimizer, beta and the rng."""
    unwrapped = accelerator.unwrap_model(model)
    trained = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in unwrapped.state_dict().items() if k in trained}
    state = dict(beta=beta, iteration=iteration, **checkpoint_record(args))
    objects = {"policy_and_value": weights, "optimizer": optimizer}
    runs.save_training(accelerator, folder, unwrapped.policy, tokenizer, state, objects, rng)


def ppo(accelerator, out, policy, tokenizer, tag_ids, env, rows, args, world, curve):
    """PPO [§3.2] from the warm-up policy: policy and value model trained, the reference frozen; per iteration a
    sampled rollout, one ppo_iteration and beta's adaptive update (impl). --resume continues from out/ppo. Returns
    the policy and its iteration count."""
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    model = PolicyAndValue(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.ppo_lr, weight_decay=1e-6)  # impl: wd 1e-6
    folder, beta, done = out / "ppo", args.kl_init, 0
    rng = random.Random(args.seed * 1000)  # the same draws on every process: each rolls out its share of a batch
    if state := runs.load_training(accelerator, folder, {"policy_and_value": model, "optimizer": optimizer}, rng):
        beta, done = state["beta"], state["iteration"]  # --resume
        accelerator.print(f"resumed PPO at iteration {done}")
    model, optimizer = accelerator.prepare(model, optimizer)
    for it in range(done, args.ppo_iterations):
        t0 = time.time()
        episodes, tokens = collect_rollout(accelerator, model, tokenizer, env, rows, args, tag_ids, rng, world, it)
        stats = ppo_iteration(accelerator, model, ref, optimizer, tokenizer, episodes, beta, args)
        if args.kl_adaptive:
            beta = update_kl_coef(beta, stats["rollout/kl"], args.kl_target)  # after each rollout (impl)
        stats |= {"iteration": it + 1, **rollout_stats(accelerator, episodes, tokens), "charts/kl_coef": beta}
        runs.log_update(accelerator, out, stats | {"charts/seconds": time.time() - t0}, step=it + 1)
        if (it + 1) % args.eval_every == 0 or it + 1 == args.ppo_iterations:
            runs.curve_point(accelerator, out, args, it + 1, curve)  # the policy trained here (the model's .policy)
            save_ppo(accelerator, folder, model, optimizer, tokenizer, beta, it + 1, args, rng)
    return accelerator.unwrap_model(model).policy, max(done, args.ppo_iterations)


def train(args):
    """The SFT warm-up [§3.1], PPO [§3.2], and the evaluations before and after each [§4]; --resume continues from
    output_dir/sft and output_dir/ppo."""
    start = time.time()
    accelerator, out = runs.start(args, "smartrag")  # the run's folder; refuses a checkpoint without --resume
    train_rows = sample_rows(load_split(args.data_dir, "train", args.question_types), args.n_train, args.seed)
    test_rows = load_split(args.data_dir, "test", args.question_types)[: args.n_eval]
    toy.check_metadata(train_rows, args, Path(args.data_dir) / "train.jsonl")
    env, warnings, world = environment(args), [], toy.renaming_world(args)  # toy renaming (header 10)
    policy, tokenizer, tag_ids, before_sft, sft_steps = warm_up(
        accelerator, args, out, train_rows, test_rows, env, world, warnings
    )
    before = evaluate_stage(accelerator, out, "sft", policy, tokenizer, env, test_rows, args, tag_ids, step=0)
    curve = lambda rows: evaluate(policy, tokenizer, env, rows, args, tag_ids, greedy=True)[0]  # greedy [§4.1]
    if not runs.load_state(out / "ppo"):  # the curve's start: the SFT model
        runs.curve_point(accelerator, out, args, 0, curve)
    policy, ppo_steps = ppo(accelerator, out, policy, tokenizer, tag_ids, env, train_rows, args, world, curve)
    after = evaluate_stage(accelerator, out, "ppo", policy, tokenizer, env, test_rows, args, tag_ids, step=ppo_steps)
    accelerator.end_training()
    steps, seconds = {"sft": sft_steps, "ppo": ppo_steps}, time.time() - start
    results = runs.result_record("smartrag", args, before_sft, before, after, steps, seconds, "policy_calls")
    runs.write_results(out, results | {"warnings": warnings}, accelerator.is_main_process, rows=TABLE_ROWS)


# --------------------------------------------------------------------------- 9. evaluation [§4], --eval, --ask
def episode_record(e):
    """What one evaluated episode scored and cost."""
    golds, retrieved = e["row"]["golden_answers"], sum(t["kind"] == "retrieve" for t in e["turns"])
    record = answer_scores(e["answer"], golds)  # FlashRAG's EM and F1 (the paper's metrics) and sub-EM
    reward = discounted_return([t["reward"] for t in e["turns"]], 1.0)
    record |= dict(reward=reward, retrieval_rate=float(retrieved > 0), retrievals=retrieved,
                   invalid=float(any(t["kind"] == "invalid" for t in e["turns"])), policy_calls=len(e["turns"]),
                   generated_tokens=sum(len(t["action_ids"]) for t in e["turns"]))  # fmt: skip
    return record | ({"hit": cover_em(e["observations"][0], golds)} if e["observations"] else {})


@runs.evaluation
def evaluate(model, tokenizer, env, rows, args, tag_ids, greedy, seed=0, batch=256):
    """EM, F1, return (gamma = 1), retrieval rate and hit, overall and by metadata group; and the episodes."""
    model.eval()
    quiet = not PartialState().is_local_main_process
    bar = runs.progress(range(0, len(rows), batch), "greedy eval" if greedy else "sampled eval", quiet, leave=False)
    episodes = [
        e for i in bar for e in rollout(model, tokenizer, env, rows[i : i + batch], args, tag_ids, greedy, seed + i)
    ]
    model.train()
    return summarize([episode_record(e) for e in episodes], [e["row"] for e in episodes]), episodes


def evaluate_stage(accelerator, out, stage, model, tokenizer, env, rows, args, tag_ids, step=None):
    """Greedy (threshold + beam) and sampled (T = 1, top-k 50) evaluations at a stage (raw, sft, ppo, eval), with
    predictions_<stage>.jsonl (golds, prediction, trajectory, cost per question and decoding) and logs."""
    with accelerator.autocast():
        greedy, kept = evaluate(model, tokenizer, env, rows, args, tag_ids, greedy=True)
        sampled, drawn = evaluate(model, tokenizer, env, rows, args, tag_ids, greedy=False, seed=args.seed + 10_000)
    if accelerator.is_main_process:
        path = lambda e: " | ".join(f"{t['kind']}: {t['text']}" for t in e["turns"])
        line = lambda e, decoding: dict(id=e["row"].get("id"), question=e["row"]["question"], decoding=decoding,
                                        golden_answers=e["row"]["golden_answers"], prediction=e["answer"],
                                        trajectory=path(e), **episode_record(e))  # fmt: skip
        write_jsonl(
            out / f"predictions_{stage}.jsonl", [line(e, "greedy") for e in kept] + [line(e, "sampled") for e in drawn]
        )
    brief = lambda r: f"em={r['em']:.3f} reward={r['reward']:.3f} retrieval={r['retrieval_rate']:.2f}"
    accelerator.print(f"{stage} | greedy {brief(greedy)} | sampled {brief(sampled)}")
    if step is not None:
        runs.log_eval(accelerator, out, stage, greedy | {"sampled": sampled}, step)
    return greedy | {"sampled": sampled}


def run_eval(args):
    """Evaluate --model (a checkpoint folder, or the untrained start) on the test split."""
    start = time.time()
    rows = load_split(args.data_dir, "test", args.question_types)[: args.n_eval]  # before any folder
    accelerator, out = runs.start_eval(args)
    accelerator.print(f"evaluation folder: {out}")
    policy, tokenizer, tag_ids = load_policy(args, accelerator.device)
    result = evaluate_stage(accelerator, out, "eval", policy, tokenizer, environment(args), rows, args, tag_ids)
    steps = {"sft": 0, "ppo": 0}
    results = runs.result_record("smartrag", args, None, result, None, steps, time.time() - start, "policy_calls")
    runs.write_results(out, results | {"warnings": []}, accelerator.is_main_process, rows=TABLE_ROWS)


def ask(args):
    """One question through Algorithm 1 with the greedy (threshold) policy, printing every step."""
    policy, tokenizer, tag_ids = load_policy(args, runs.make_accelerator().device)
    if unknown := unknown_words(tokenizer, args.ask):
        print(f"warning: words the model's tokenizer does not know (read as <unk>): {' '.join(unknown)}")
    row = {"id": "ask", "question": args.ask, "golden_answers": [""], "metadata": {}}
    episode = rollout(policy, tokenizer, environment(args), [row], args, tag_ids, greedy=True, seed=args.seed)[0]
    for n, turn in enumerate(episode["turns"]):
        forced = " (answer forced at the quota)" if turn["forced_ids"] else ""
        print(f"step {n}: {turn['kind']} | {turn['text']}{forced}")
        if n < len(episode["observations"]):
            print(f"  observation: {episode['observations'][n]}")
    print(f"answer: {episode['answer']}")


# --------------------------------------------------------------------------- 10. main
def main(argv=None):
    """Parse the flags, fill the preset, dispatch on the mode."""
    args = runs.parse_args(Args, argv, UNTRAINED, method="smartrag", presets=PRESETS)
    try:
        args = apply_preset(args)
    except SystemExit as problems:  # --dry_run: these and the missing paths and models, at once
        if not args.dry_run:
            raise
        try:
            runs.dry_run(args)
        except SystemExit as missing:
            raise SystemExit(f"{problems.code}; {missing.code}") from None
        raise
    (runs.dry_run if args.dry_run else train if args.train else run_eval if args.eval else ask)(args)


if __name__ == "__main__":
    runs.run_main(main)  # a user's mistake (bad file, missing field) ends in one line, not a traceback
