# Paper: SmartRAG: Jointly Learn RAG-Related Tasks From the Environment Feedback (ICLR 2025, arXiv:2410.18141) — docs: docs/smartrag.md
"""SmartRAG: one policy LM decides whether to retrieve, writes the search query, and answers; trained end to end.

The policy reads the state s = [question, observations] and emits an action whose first token is a tag:
`[Answer] <answer>` ends the episode, `[Search] <query>` calls a frozen retriever and appends its top-K snippets to
the observations (Algorithm 1, quota N, answer forced at the quota). A warm-up SFT teaches the format on three pair
types (Eq. 2-4; the "filtered" initial policy keeps only the pairs that fit what the base model already knows), then
PPO optimises the whole multi-step episode against the environment reward EM + F1 - alpha per retrieval (Eq. 5-6),
with a value model, a frozen reference, a per-token adaptive KL penalty and GAE across the retrieve and answer actions,
so the search decision and the query tokens get credit from the answer.

    python smartrag.py --train --run_name smartrag          # toy world, tiny model, CPU: SFT, PPO, evaluation
    python smartrag.py --eval --model runs/smartrag/ppo          # evaluate a checkpoint on the toy test split
    python smartrag.py --ask "what is the birthplace of sazebox ?" --model runs/smartrag/ppo
    accelerate launch smartrag.py --train --preset paper --data_dir data/smartrag --index indexes/e5_wiki18

Deviations from the paper (each marked `# simplification:` where it lives):
1. Retriever: the paper uses Bing web search (top-4 snippets); here a frozen local retriever over a FlashRAG corpus
   (faiss dense index, or TF-IDF in the toy world) renders its top-K passages as "title: text" snippets.
2. Base models: causal LMs only (the paper's main model is the seq2seq Flan-T5-large; LLaMA-2-7B with LoRA is the
   paper preset here). The toy preset uses a 0.6M-parameter Qwen2 and a compact template (same fields and tags).
3. PPO batches are sequences (one per action), not the 32 token transitions of the authors' RL4LMs code; advantages
   are whitened per minibatch, the value model is a copy of the SFT policy with a bias-free linear head.
4. Toy world only: the warm-up rewriter (GPT-3.5 in the paper) is the oracle entity+relation rewrite from the
   question's metadata, the "does the base model know it" probe is the toy reader (the world's parametric memory),
   and SFT demonstrations get entity-renaming augmentation (a tiny model otherwise memorises instead of reading);
   so do PPO episodes of not-popular training questions (--rl_augment_p: question, passages and golds renamed
   through one bijection of the world's names, the queries mapped back to search the real corpus).
   The raw toy-lm knows nothing, unlike the paper's pretrained base LLMs, so the toy base model first learns to
   answer the popular training questions directly (--base_pretrain_steps, in the template-1 prompt, no tag): its
   parametric knowledge, which the decision to skip retrieval needs (docs/smartrag.md, "Toy results").
   The toy preset trains and evaluates on one-hop questions (a PopQA-like mix of known, retrievable and unanswerable
   facts; --question_types "" uses every type).
5. SFT trains for a number of steps (toy) or epochs (paper: 1); evaluation decodes with beam search after the
   first-token threshold (paper: 4 beams; toy: 1, i.e. greedy). The toy preset's PPO takes 128 questions per rollout
   and one minibatch of all their sequences at lr 1e-4 (paper: 5120 tokens, minibatches of 32, lr 2e-6): smaller
   noisy minibatches made the tiny policy drift without gain (docs/smartrag.md, "Toy results").
6. gamma discounts per token (impl, RL4LMs), where Eq. 6 discounts per step: the retrieval cost seen from the answer
   grows with the query length (about 0.27 for 4 tokens, 0.84 for 50 at gamma 0.99).
7. Unlisted in the paper: SFT uses AdamW betas (0.9, 0.98), a linear warm-up of min(50, steps/10) steps, linear decay
   to a floor of 0.1 x lr, and gradient clipping at 1.0; the value head is zero-initialised.
8. An empty search query searches with the question (the paper does not say what an empty query does).
9. Toy world: the knowledge probe is the toy reader's parametric memory, which is exactly the `popular` flag.
10. Metrics: EM and F1 as the paper reports them (FlashRAG's definitions); `acc` (sub-EM) is logged beside them.
"""
import copy
import math
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm import tqdm
from transformers import HfArgumentParser, set_seed

from common.data import load_split, sample_rows, write_jsonl
from common.llm import chat_prompts, generate, left_pad, load_model_and_tokenizer, make_llm, right_pad, unknown_words
from common.metrics import cover_em, exact_match, f1_score, sub_exact_match
from common.retrieval import open_retriever
from common.runs import (append_metrics, load_state, make_accelerator, refuse_training_results, rng_states, run_main,
                         save_checkpoint, set_rng_states, start_run, write_results)
from common.toy import apply_mapping, rename_entities, renamed_row


@dataclass
class Args:
    # experiment
    preset: str = field(default="toy", metadata={"help": "toy (built-in toy world, tiny model, CPU) or paper"})
    train: bool = field(default=False, metadata={"help": "SFT warm-up, then PPO, then evaluation"})
    eval: bool = field(default=False, metadata={"help": "evaluate --model (a checkpoint or the untrained start)"})
    ask: str = field(default="", metadata={"help": "answer one question with --model and print the trajectory"})
    output_dir: Optional[str] = field(default=None, metadata={
        "help": "results, metrics and checkpoints (default: runs/<run_name>; --eval: <model>/eval)"})
    run_name: Optional[str] = field(default=None, metadata={"help": "a training run's name: smartrag__<seed>__<time>"})
    resume: bool = field(default=False, metadata={"help": "continue the run --run_name / --output_dir"})
    report_to: str = field(default="none", metadata={"help": "tracker beside metrics.jsonl (accelerate)",
                                                      "choices": ["none", "tensorboard", "wandb"]})
    seed: int = field(default=0, metadata={"help": "seed of models, sampling and data order"})
    # data, retriever, model
    data_dir: Optional[str] = field(default=None, metadata={"help": "folder with train/test jsonl (FlashRAG QA)"})
    corpus: Optional[str] = field(default=None, metadata={"help": "FlashRAG corpus jsonl (default: data_dir/corpus.jsonl)"})
    index: str = field(default="", metadata={"help": "saved retriever folder (python -m common.retrieval build)"})
    encoder: Optional[str] = field(default=None, metadata={"help": "tfidf, bm25, or a dense encoder (hub id / folder) when --index is empty"})
    model: Optional[str] = field(default=None, metadata={"help": "policy: hub id, local folder or toy-lm spec"})
    lora_r: Optional[int] = field(default=None, metadata={"help": "LoRA rank, 0 = full fine-tuning [App. A.3: LoRA for LLaMA]"})
    gradient_checkpointing: Optional[bool] = field(default=None, metadata={"help": "recompute activations in backward (memory)"})
    templates: Optional[str] = field(default=None, metadata={"help": "paper (Table 7 verbatim) or compact"})
    n_train: Optional[int] = field(default=None, metadata={"help": "training questions (None: all)"})
    n_eval: Optional[int] = field(default=None, metadata={"help": "test questions evaluated (None: all)"})
    question_types: Optional[str] = field(default=None, metadata={"help": "comma-separated metadata types to use (empty: all)"})
    # Algorithm 1 and reward
    quota: int = field(default=1, metadata={"help": "retrieval quota N [Alg. 1; §4: N = 1]"})
    top_k: Optional[int] = field(default=None, metadata={"help": "snippets per retrieval K [App. A.3: 4]"})
    alpha: float = field(default=0.2, metadata={"help": "retrieval cost alpha [Eq. 5; App. A.3: 0.2]"})
    invalid_reward: float = field(default=-1.0, metadata={"help": "reward of an action without a tag (impl: -1, ends)"})
    # warm-up SFT [§3.1]
    initial_policy: str = field(default="filtered", metadata={"help": "plain (pi_0: pairs 2-4 for all) or filtered (pi_0*)"})
    rewriter: Optional[str] = field(default=None, metadata={"help": "oracle (metadata sub_queries) or an LLM spec [App. A.2: gpt-3.5]"})
    rewriter_model: str = field(default="", metadata={"help": "model name when --rewriter is an endpoint URL"})
    base_llm: Optional[str] = field(default=None, metadata={"help": "LLM spec that plays the base model's knowledge probe"})
    know_f1: float = field(default=0.2, metadata={"help": "base model 'knows' x if its direct-answer F1 >= this [App. A.2]"})
    base_pretrain_steps: Optional[int] = field(default=None, metadata={"help": "toy: steps teaching the raw base model the popular facts"})
    sft_epochs: float = field(default=1.0, metadata={"help": "SFT epochs [§4: 1] (ignored when --sft_steps > 0)"})
    sft_steps: Optional[int] = field(default=None, metadata={"help": "SFT steps; overrides epochs when > 0"})
    sft_lr: Optional[float] = field(default=None, metadata={"help": "SFT learning rate [§4: 3e-4]"})
    sft_batch_size: Optional[int] = field(default=None, metadata={"help": "SFT batch size [§4: 8]"})
    augment_p: Optional[float] = field(default=None, metadata={"help": "entity-renaming probability for retrieval pairs"})
    rl_augment_p: Optional[float] = field(default=None, metadata={"help": "renaming probability of a not-popular PPO episode"})
    # PPO [§3.2, §4]
    ppo_iterations: Optional[int] = field(default=None, metadata={"help": "PPO iterations (impl: 100 for T5-large)"})
    rollout_tokens: Optional[int] = field(default=None, metadata={"help": "generated tokens per iteration [§4: 5120]"})
    rollout_batch: Optional[int] = field(default=None, metadata={"help": "questions per batched rollout"})
    ppo_epochs: Optional[int] = field(default=None, metadata={"help": "epochs over each rollout [§4: 1]"})
    ppo_lr: Optional[float] = field(default=None, metadata={"help": "PPO learning rate [§4: 2e-6]"})
    ppo_batch_size: Optional[int] = field(default=None, metadata={"help": "sequences per PPO minibatch [§4: 32]"})
    gamma: float = field(default=0.99, metadata={"help": "discount [Eq. 6] (impl: 0.99 per token)"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda (impl: 0.95)"})
    clip: float = field(default=0.2, metadata={"help": "PPO clip epsilon (impl: 0.2)"})
    vf_coef: float = field(default=0.5, metadata={"help": "value loss coefficient (impl: 0.5)"})
    max_grad_norm: float = field(default=0.5, metadata={"help": "gradient clipping (impl: 0.5)"})
    kl_init: float = field(default=0.001, metadata={"help": "initial KL coefficient beta (impl: 0.001, adaptive)"})
    kl_target: float = field(default=0.2, metadata={"help": "target KL of the adaptive controller (impl: 0.2)"})
    kl_adaptive: bool = field(default=True, metadata={"help": "adapt beta to kl_target after each rollout (impl); False: fixed"})
    sample_top_k: int = field(default=50, metadata={"help": "top-k sampling in rollouts [App. A.3: 50]"})
    max_new_tokens: Optional[int] = field(default=None, metadata={"help": "tokens per action (impl: 50)"})
    # inference [§4.1, App. A.3]
    threshold: float = field(default=0.5, metadata={"help": "retrieve iff p([Search]) at the first token > threshold"})
    num_beams: Optional[int] = field(default=None, metadata={"help": "beams after the first token (impl: 4)"})
    eval_every: int = field(default=25, metadata={"help": "evaluate and checkpoint every this many PPO iterations"})


PRESETS = {  # values for the fields left at None; any flag overrides them
    "toy": dict(data_dir="data/toy", encoder="tfidf", model="toy-lm", lora_r=0, templates="compact", top_k=1, question_types="one_hop", rewriter="oracle",
                base_llm="toy", base_pretrain_steps=300, sft_steps=1200, sft_lr=2e-3, sft_batch_size=64, augment_p=1.0, rl_augment_p=1.0, ppo_iterations=60,
                rollout_tokens=0, rollout_batch=128, ppo_epochs=1, ppo_lr=1e-4, ppo_batch_size=256, max_new_tokens=8, num_beams=1,
                n_eval=None, gradient_checkpointing=False),
    "paper": dict(data_dir="data/smartrag", encoder="intfloat/e5-base-v2", model="meta-llama/Llama-2-7b-chat-hf", lora_r=16, templates="paper",
                  top_k=4, question_types="", rewriter="", base_llm="hf:meta-llama/Llama-2-7b-chat-hf", base_pretrain_steps=0, sft_steps=0, sft_lr=3e-4,
                  sft_batch_size=8, augment_p=0.0, rl_augment_p=0.0, ppo_iterations=50, rollout_tokens=5120, rollout_batch=64, ppo_epochs=1,
                  ppo_lr=2e-6, ppo_batch_size=32, max_new_tokens=50, num_beams=4, n_eval=None,
                  gradient_checkpointing=True),  # a 7B policy, value model and reference on one 80 GB GPU: docs/benchmarks.md
}


def apply_preset(args):
    """Fill the fields left at None from the preset."""
    if args.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.corpus = args.corpus or str(Path(args.data_dir) / "corpus.jsonl")
    if args.base_llm == "toy":  # the toy reader of the world being trained on, never data/toy by default
        args.base_llm = f"toy:{args.data_dir}"
    if args.output_dir is None and args.eval:  # --eval writes next to the model, never over a training run's results
        args.output_dir = str(Path(args.model) / "eval") if Path(args.model).is_dir() else "runs/smartrag-eval"
    if args.preset == "paper" and not args.rewriter and args.train:
        raise SystemExit("--preset paper --train needs --rewriter (an LLM spec, e.g. an OpenAI-compatible URL for "
                         "gpt-3.5-turbo-1106 with --rewriter_model) to build the warm-up queries [App. A.2]")
    return args


# --------------------------------------------------------------------------- 1. templates and parsing [App. A.3, Tab. 7]
ANSWER_TAG, RETRIEVE_TAG = "[Answer]", "[Search]"  # the paper writes [ANSWER]/[RETRIEVE]; Table 7 and the code use these

_INTRO = ("You will be presented with a question. If you know the answer, please respond directly. If you don't know "
          "the answer, use the Bing search engine to find the necessary information and then answer the question "
          "based on your observation.")
TEMPLATES = {  # (no observation, with observations): [Tab. 7] verbatim, and the compact toy form with the same fields
    "paper": (
        _INTRO + "\n\nQuestion: {input}\n\nPlease format your output as follows:\n\n1. If you choose to answer the "
        "question directly, please use: '[Answer] YOUR_ANSWER'\n2. If you choose to use the Bing search engine, please "
        "use:\n'[Search] YOUR_SEARCH_QUERY'\n\nPlease output:",
        _INTRO + "\n\nQuestion: {input}\n\nObservation: {search}\n\nPlease format your output as follows:\n\n1. If you "
        "choose to answer the question directly, please use: '[Answer] YOUR_ANSWER'\n2. If you choose to use the Bing "
        "search engine, please use:\n\n'[Search] YOUR_SEARCH_QUERY'\n\nPlease output:"),
    "compact": ("question : {input} output :", "question : {input} observation : {search} output :"),
}
REWRITE_PROMPT = ("Assuming you are a professional retrieval model, rewrite the following question into a query that "
                  "is more suitable for retrieval: {question}")  # [App. A.2] verbatim


def render_state(question, observations, templates):
    """The prompt of state s = [x, os] [Eq. 1]: template 1 without observations, template 2 with them joined."""
    without, with_obs = TEMPLATES[templates]
    if not observations:
        return without.format(input=question)
    return with_obs.format(input=question, search=" ".join(observations))  # N > 1: one Observation slot (spec §9.17)


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
        return exact_match(text, golds) + f1_score(text, golds)
    return -alpha if kind == "retrieve" else invalid_reward


def discounted_return(rewards, gamma):
    """sum_t gamma^t r(t) over the steps of a trajectory [Eq. 6]."""
    return sum(gamma ** t * r for t, r in enumerate(rewards))


# --------------------------------------------------------------------------- 3. warm-up data [§3.1, Eq. 2-4, App. A.2]
def knows_answer(prediction, golds, know_f1):
    """The base model 'knows' x when its direct answer has F1 >= 0.2 against the golds [App. A.2]."""
    return f1_score(prediction, golds) >= know_f1 - 1e-9  # 0.2 is not exact in floating point (spec §8.11)


def warmup_examples(row, query, observation, knows, initial_policy):
    """The SFT pairs of one question as text fields: (2) direct answer, (3) retrieve + query, (4) answer with obs."""
    meta = row.get("metadata", {})  # used only by the toy world's renaming augmentation
    tags = dict(popular=meta.get("popular", False), searched=meta.get("entities", [])[:1])
    answer = row["golden_answers"][0]  # first alias as target (spec §9.15)
    direct = dict(question=row["question"], observations=[], tag="answer", text=answer, **tags)           # [Eq. 2]
    search = dict(question=row["question"], observations=[], tag="retrieve", text=query, **tags)          # [Eq. 3]
    read = dict(question=row["question"], observations=[observation], tag="answer", text=answer, **tags)  # [Eq. 4]
    if initial_policy == "plain":  # pi_theta_0: all three pairs, so (2) and (3) share one input [§3.1]
        return [direct, search, read]
    return [direct] if knows else [search, read]  # pi_theta_0*: keep what fits the base model's knowledge [§3.1]


def rewrite_queries(rows, args):
    """Warm-up queries: the paper's GPT-3.5 rewrite prompt on any LLM backend, or the oracle rewrite of the toy world."""
    if args.rewriter == "oracle":  # simplification: toy-world stand-in for GPT-3.5, the entity + relation of hop 1
        return [r["metadata"]["sub_queries"][0] for r in rows]
    llm = make_llm(args.rewriter, **({"model": args.rewriter_model} if args.rewriter_model else {}))
    prompts = [[{"role": "user", "content": REWRITE_PROMPT.format(question=r["question"])}] for r in rows]
    return [q.strip() or r["question"] for q, r in zip(llm.chat(prompts, temperature=0.0, max_tokens=64), rows)]


def probe_knowledge(rows, args):
    """Which training questions the base model answers directly (F1 >= know_f1), asked with the direct template."""
    llm = make_llm(args.base_llm)  # simplification: in the toy world, the toy reader (header item 9)
    prompts = [[{"role": "user", "content": render_state(r["question"], [], args.templates)}] for r in rows]
    replies = llm.chat(prompts, temperature=0.0, max_tokens=32)
    strip_tag = lambda reply: reply.replace(ANSWER_TAG, "").strip()  # a chat model may echo the format
    return [knows_answer(strip_tag(reply), r["golden_answers"], args.know_f1) for reply, r in zip(replies, rows)]


def build_warmup(rows, retriever, args):
    """All SFT examples of the training questions (retrieval with the rewritten query, as Eq. 4 says)."""
    queries = rewrite_queries(rows, args)
    observations = [format_observation(h) for h in retriever.search(queries, args.top_k)]
    knows = probe_knowledge(rows, args) if args.initial_policy == "filtered" else [False] * len(rows)
    examples = [e for row, q, o, k in zip(rows, queries, observations, knows)
                for e in warmup_examples(row, q, o, k, args.initial_policy)]
    return examples, sum(knows) / max(len(rows), 1)


# --------------------------------------------------------------------------- 4. model plumbing kept visible
class PolicyAndValue(torch.nn.Module):
    """The policy LM and a value model (a copy of its backbone, without the LM head, and a bias-free scalar head),
    wrapped for one prepare(). The critic never computes the vocabulary-wide logits it would throw away."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.value_backbone = backbone_of(copy.deepcopy(policy))  # impl: a separate copy of the SFT model
        self.value_head = torch.nn.Linear(policy.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.value_head.weight)  # simplification: zero-initialised value head (header item 7)

    def forward(self, input_ids, attention_mask):
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
        hidden = self.value_backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return logits, self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # (B, T)


def backbone_of(model):
    """The transformer body of a causal LM (LoRA layers included), without its LM head."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the wrapped transformers model
    return model.base_model


def add_tags(model, tokenizer):
    """Register [Answer] and [Search] as single tokens and return their ids [spec §2.1]."""
    new = [t for t in (ANSWER_TAG, RETRIEVE_TAG) if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
        model.resize_token_embeddings(len(tokenizer))
    return {"answer": tokenizer.convert_tokens_to_ids(ANSWER_TAG), "retrieve": tokenizer.convert_tokens_to_ids(RETRIEVE_TAG)}


def load_policy(args, device):
    """The policy LM and tokenizer, with the two tags (and LoRA adapters when lora_r > 0)."""
    # fp32 master weights, bf16 autocast (accelerate mixed precision); only a frozen LoRA base may be stored in bf16
    dtype = torch.bfloat16 if device.type == "cuda" and args.lora_r else torch.float32
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, world=args.data_dir)
    tag_ids = add_tags(model, tokenizer)
    if args.lora_r and not hasattr(model, "peft_config"):
        from common.llm import add_lora
        model = add_lora(model, dict(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                     trainable_token_indices=sorted(tag_ids.values())))  # tags' rows: trained, saved
    for p in model.parameters():  # never Adam on bf16 weights: every trained parameter is fp32
        if p.requires_grad:
            p.data = p.data.float()
    if args.gradient_checkpointing:  # only in train mode; rollouts run in eval mode with the KV cache
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device), tokenizer, tag_ids


def encode_states(tokenizer, states):
    """Token ids of rendered states, through the chat template when the tokenizer has one."""
    texts = chat_prompts(tokenizer, [[{"role": "user", "content": s}] for s in states]) if tokenizer.chat_template else states
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def first_token_probs(model, prompts, pad_id):
    """p(next token) at the end of each prompt, (B, V), for the retrieval threshold [§4.1]."""
    ids, mask = (t.to(model.device) for t in left_pad(prompts, pad_id))  # (B, T) each
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float().softmax(-1)


# --------------------------------------------------------------------------- 5. rollout [Alg. 1], batched per turn
def rollout(model, tokenizer, retriever, rows, args, tag_ids, greedy, seed):
    """Run Algorithm 1 for a batch of questions: one generate call per turn for all live episodes.

    Returns one episode per row: {"row", "turns": [{prompt_ids, forced_ids, action_ids, kind, text, reward}],
    "observations", "answer"}. The forced [Answer] at the quota is part of the state (forced_ids), not the action.
    """
    episodes = [{"row": r, "turns": [], "observations": [], "answer": "", "done": False} for r in rows]
    for n in range(args.quota + 1):  # [Alg. 1 L2] while n <= N
        live = [e for e in episodes if not e["done"]]
        if not live:
            break
        prompts = encode_states(tokenizer, [render_state(e["row"]["question"], e["observations"], args.templates) for e in live])
        if n == args.quota:  # [Alg. 1 L3-4] the quota is met: force a_0 = [ANSWER]
            prefixes = [[tag_ids["answer"]] for _ in live]
        elif greedy:  # [§4.1, App. A.3] threshold on p([Search]) decides the first token, beam search the rest
            p_retrieve = first_token_probs(model, prompts, tokenizer.pad_token_id)[:, tag_ids["retrieve"]]
            prefixes = [[tag_ids["retrieve"] if p > args.threshold else tag_ids["answer"]] for p in p_retrieve.tolist()]
        else:  # [App. A.3] top-k sampling, the first token sampled freely
            prefixes = [[] for _ in live]
        gen = generate(model, tokenizer, [p + f for p, f in zip(prompts, prefixes)], args.max_new_tokens,
                       do_sample=not greedy, top_k=args.sample_top_k, num_beams=args.num_beams if greedy else 1,
                       seed=seed + n)
        forced = n == args.quota
        for e, prompt, prefix, ids in zip(live, prompts, prefixes, gen.token_ids):
            action = prefix + ids  # the decided tag (threshold) counts as the policy's own choice
            kind, text = parse_action(action, tag_ids, tokenizer)
            reward = step_reward(kind, text, e["row"]["golden_answers"], args.alpha, args.invalid_reward)
            e["turns"].append(dict(prompt_ids=prompt, forced_ids=prefix if forced else [],
                                   action_ids=ids if forced else action, kind=kind, text=text, reward=reward))
            e["done"] = kind != "retrieve"  # [Alg. 1 L8-10] an answer (or an invalid action) ends the episode
            e["answer"] = text if kind == "answer" else e["answer"]
        searching = [e for e in live if not e["done"]]
        for e, o in zip(searching, search(retriever, searching, args.top_k)):  # [Alg. 1 L9] o = R(a_1:), os = [os, o]
            e["observations"].append(o)
    return episodes


def search(retriever, episodes, top_k):
    """The observation of each episode's last query (the question when the query is empty), one batched search."""
    queries = [e["turns"][-1]["text"] or e["row"]["question"] for e in episodes]  # simplification: header item 8
    renames = [e["row"].get("rename") for e in episodes]  # simplification: toy-world RL augmentation (header item 4)
    queries = [apply_mapping([q], r[1])[0] if r else q for q, r in zip(queries, renames)]  # back to the real corpus
    observations = [format_observation(h) for h in retriever.search(queries, top_k)]
    return [apply_mapping([o], r[0])[0] if r else o for o, r in zip(observations, renames)]  # and forward again


# --------------------------------------------------------------------------- 6. PPO pieces [§3.2]
def gae(rewards, values, gamma, lam):
    """Advantages and returns over one episode's action tokens, concatenated across actions (done only at the end)."""
    # simplification: gamma per token, not per step as in Eq. 6 (header item 6)
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0  # across the action boundary: V of the next state
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def update_kl_coef(beta, kl_mean, target):
    """Adaptive KL controller (impl, RL4LMs): beta * (1 + 0.1 * clip((KL - target) / target, -0.2, 0.2))."""
    return beta * (1 + 0.1 * min(max((kl_mean - target) / target, -0.2), 0.2))


def ppo_losses(new_logp, old_logp, advantages, values, returns, mask, clip):
    """Clipped surrogate and value MSE, means over the action tokens (mask) [PPO, Schulman et al. 2017]."""
    ratio = torch.exp(new_logp - old_logp)  # (B, T)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))  # (B, T)
    n = mask.sum().clamp(min=1)
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


def score_rollout(episodes, seqs, logp, ref_logp, values, mask, beta, args):
    """Per-token rewards (-beta * KL, plus the env reward on each action's last token), then GAE per episode."""
    kl = (logp - ref_logp) * mask  # (B, T-1) k1 estimate, in the reward (impl)
    rewards = -beta * kl
    last = mask.cumsum(-1).argmax(-1)  # (B,) index of each sequence's last action token
    rewards[torch.arange(len(seqs)), last] += torch.tensor([s["reward"] for s in seqs], device=rewards.device)
    advantages, returns = torch.zeros_like(rewards), torch.zeros_like(rewards)
    by_episode = defaultdict(list)
    for row, s in enumerate(seqs):
        by_episode[s["episode"]].append(row)
    for rows in by_episode.values():  # one GAE over all actions of the episode [spec §5.4]
        cols = [mask[r].nonzero().squeeze(-1) for r in rows]
        adv, ret = gae(torch.cat([rewards[r, c] for r, c in zip(rows, cols)]).tolist(),
                       torch.cat([values[r, c] for r, c in zip(rows, cols)]).tolist(), args.gamma, args.lam)
        start = 0
        for r, c in zip(rows, cols):
            advantages[r, c] = torch.tensor(adv[start:start + len(c)], device=rewards.device)
            returns[r, c] = torch.tensor(ret[start:start + len(c)], device=rewards.device)
            start += len(c)
    return advantages, returns, (kl.sum() / mask.sum().clamp(min=1)).item()


def ppo_iteration(accelerator, model, ref, optimizer, tokenizer, episodes, beta, args):
    """One PPO update on a rollout: score it, then ppo_epochs passes of minibatches. Returns logged stats."""
    seqs, pad, device = sequences_of(episodes), tokenizer.pad_token_id, accelerator.device
    model.eval()  # behaviour log-probs without dropout (LoRA dropout in the paper preset), as in the rollout
    with torch.no_grad():  # in chunks of a minibatch: (B, T, V) logits of a whole rollout need not fit at once
        width = max(len(s["ids"]) for s in seqs) - 1
        chunks = [seqs[i:i + args.ppo_batch_size] for i in range(0, len(seqs), args.ppo_batch_size)]
        scored = [forward_logp_values(model, c, pad, device) for c in chunks]
        old_logp, old_values = (torch.cat([F.pad(x[k], (0, width - x[k].shape[1])) for x in scored]) for k in (0, 1))
        ref_logp = torch.cat([F.pad(lp, (0, width - lp.shape[1])) for lp, _ in
                              (forward_logp_values(ref, c, pad, device, with_values=False) for c in chunks)])
    model.train()
    mask = right_pad([s["loss_mask"] for s in seqs], 0).to(device)[:, 1:].float()  # (B, T-1) shifted with the labels
    advantages, returns, kl_mean = score_rollout(episodes, seqs, old_logp, ref_logp, old_values, mask, beta, args)
    stats = defaultdict(list)
    # every process must take the same number of optimizer steps (DDP): minibatch count from the smallest rollout
    n_minibatches = math.ceil(accelerator.gather(torch.tensor([len(seqs)], device=device)).min().item() / args.ppo_batch_size)
    for _ in range(args.ppo_epochs):
        for batch in torch.randperm(len(seqs)).tensor_split(n_minibatches):
            m = mask[batch]
            a = advantages[batch]
            mean = (a * m).sum() / m.sum()
            std = (((a - mean) ** 2 * m).sum() / m.sum()).sqrt()
            a = (a - mean) / (std + 1e-8)  # impl: advantages whitened per minibatch
            logp, values = forward_logp_values(model, [seqs[i] for i in batch.tolist()], pad, device)
            width = logp.shape[1]
            pg, vf, ratio = ppo_losses(logp, old_logp[batch, :width], a[:, :width], values, returns[batch, :width],
                                       m[:, :width], args.clip)
            optimizer.zero_grad()
            accelerator.backward(pg + args.vf_coef * vf)
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            stats["losses/policy"].append(pg.item())
            stats["losses/value"].append(vf.item())
            mw = m[:, :width]
            stats["losses/clipfrac"].append((((ratio - 1).abs() > args.clip).float() * mw).sum().item() / mw.sum().item())
            log_ratio = (logp - old_logp[batch, :width]).detach()
            stats["losses/approx_kl"].append((((log_ratio.exp() - 1) - log_ratio) * mw).sum().item() / mw.sum().item())  # k3
    ret, val = returns[mask.bool()], old_values[mask.bool()]
    stats["losses/explained_variance"] = [(1 - (ret - val).var() / ret.var().clamp(min=1e-8)).item()]
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    out["rollout/kl"] = kl_mean
    out["rollout/frac_trained_tokens"] = (mask.sum() / right_pad([[1] * len(s["ids"]) for s in seqs], 0).sum()).item()
    return out


# --------------------------------------------------------------------------- 7. SFT warm-up [§3.1, §4]
def sft_batch(examples, tokenizer, tag_ids, args, rng, world):
    """Tokenised (ids, labels) of a batch; retrieval pairs renamed with probability augment_p (toy world)."""
    seqs = []
    for ex in examples:
        texts = [ex["question"], *ex["observations"], ex["text"]]
        if world is not None and (ex["tag"] == "retrieve" or ex["observations"]) and rng.random() < args.augment_p:
            # simplification: toy-world augmentation (header item 4), as bench/toy_sft.py found: searched names onto
            # non-popular ones, other names onto any (docs/toy_world.md)
            texts = rename_entities(texts, world, rng, popular="keep" if ex["popular"] else "free", searched=ex["searched"])
        prompt = encode_states(tokenizer, [render_state(texts[0], texts[1:-1], args.templates)])[0]
        tag = [tag_ids[ex["tag"]]] if ex["tag"] else []  # no tag: the toy base model's pretraining (header item 4)
        target = tag + tokenizer(" " + texts[-1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append((prompt + target, [-100] * len(prompt) + target))  # loss on the target only
    ids = right_pad([s[0] for s in seqs], tokenizer.pad_token_id)
    return ids, right_pad([s[1] for s in seqs], -100), right_pad([[1] * len(s[0]) for s in seqs], 0)


def sft(accelerator, model, tokenizer, tag_ids, examples, args, world, steps=None, name="sft"):
    """Cross-entropy on the targets of the warm-up pairs; AdamW, linear decay [§4: 1 epoch, lr 3e-4, batch 8]."""
    rng = random.Random(args.seed)
    steps = steps or args.sft_steps or math.ceil(args.sft_epochs * len(examples) / args.sft_batch_size)
    # simplification: betas, warm-up, decay floor and clipping are ours (header item 7)
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
        batch, order = order[:args.sft_batch_size], order[args.sft_batch_size:]
        batch = batch[accelerator.process_index::accelerator.num_processes]  # same order on every rank, own share
        ids, labels, attention = (t.to(accelerator.device) for t in sft_batch([examples[i] for i in batch], tokenizer, tag_ids, args, rng, world))
        logits = model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            accelerator.print(f"{name} step {step + 1}/{steps} | loss={sum(losses[-100:]) / len(losses[-100:]):.4f}")
    return accelerator.unwrap_model(model), steps


def pretrain_toy_base(accelerator, model, tokenizer, tag_ids, rows, args):
    """Toy world only: the raw toy-lm knows nothing, while the paper's base LLMs know popular facts, the premise of
    the filtered warm-up and of learning when not to retrieve. So the toy base model first learns to answer the
    popular training questions directly in the template-1 prompt (no tag), as a pretrained LLM answers what it knows."""
    examples = [dict(question=r["question"], observations=[], tag=None, text=r["golden_answers"][0], popular=True,
                     searched=[]) for r in rows if r.get("metadata", {}).get("popular")]
    if not examples:
        raise SystemExit("--base_pretrain_steps needs training questions with metadata.popular (the toy world's)")
    return sft(accelerator, model, tokenizer, tag_ids, examples, args, None, args.base_pretrain_steps, "base pretraining")[0]


# --------------------------------------------------------------------------- 8. evaluation [§4, spec §6.2]
def evaluate(model, tokenizer, retriever, rows, args, tag_ids, greedy, seed=0, batch=256):
    """EM, F1, return (gamma = 1), retrieval rate and hit, overall and by metadata group (type, popular, answerable)."""
    model.eval()
    bar = tqdm(range(0, len(rows), batch), desc="greedy eval" if greedy else "sampled eval", leave=False,
               disable=not PartialState().is_local_main_process)
    episodes = [e for i in bar
                for e in rollout(model, tokenizer, retriever, rows[i:i + batch], args, tag_ids, greedy, seed + i)]
    model.train()
    groups = defaultdict(lambda: defaultdict(list))
    for e in episodes:
        meta = e["row"].get("metadata", {})
        keys = ["all"] + [f"{k}={meta[k]}" for k in ("type", "popular", "answerable") if k in meta]
        for key in keys:
            for name, value in episode_record(e).items():
                groups[key][name].append(value)
    summary = {k: {name: sum(v) / len(v) for name, v in g.items()} | {"n": len(g["em"])} for k, g in groups.items()}
    return summary["all"] | {"groups": {k: v for k, v in summary.items() if k != "all"}}, episodes


def episode_record(e):
    """What one evaluated episode scored and cost."""
    golds, retrieved = e["row"]["golden_answers"], sum(t["kind"] == "retrieve" for t in e["turns"])
    record = dict(em=exact_match(e["answer"], golds), f1=f1_score(e["answer"], golds),
                  acc=sub_exact_match(e["answer"], golds),  # FlashRAG's Sub_ExactMatch; the paper reports EM and F1
                  reward=discounted_return([t["reward"] for t in e["turns"]], 1.0),
                  retrieval_rate=float(retrieved > 0), retrievals=retrieved,
                  invalid=float(any(t["kind"] == "invalid" for t in e["turns"])),
                  policy_calls=len(e["turns"]), generated_tokens=sum(len(t["action_ids"]) for t in e["turns"]))
    return record | ({"hit": cover_em(e["observations"][0], golds)} if e["observations"] else {})


def evaluate_both(model, tokenizer, retriever, rows, args, tag_ids, predictions=None):
    """Greedy (threshold + beam) and sampled (T = 1, top-k 50) evaluations, reported separately; one line per
    question and decoding in the jsonl file `predictions` (golds, prediction, trajectory, cost) when given."""
    greedy, kept = evaluate(model, tokenizer, retriever, rows, args, tag_ids, greedy=True)
    sampled, drawn = evaluate(model, tokenizer, retriever, rows, args, tag_ids, greedy=False, seed=args.seed + 10_000)
    if predictions is not None and PartialState().is_main_process:
        write_jsonl(predictions, [{"id": e["row"].get("id"), "question": e["row"]["question"], "decoding": decoding,
                                   "golden_answers": e["row"]["golden_answers"], "prediction": e["answer"],
                                   "trajectory": " | ".join(f"{t['kind']}: {t['text']}" for t in e["turns"]),
                                   **episode_record(e)} for decoding, eps in (("greedy", kept), ("sampled", drawn))
                                  for e in eps])
    return greedy | {"sampled": sampled}


def brief(result):
    """One log line of an evaluation."""
    s = result["sampled"]
    return (f"greedy em={result['em']:.3f} reward={result['reward']:.3f} retrieval={result['retrieval_rate']:.2f} | "
            f"sampled em={s['em']:.3f} reward={s['reward']:.3f} retrieval={s['retrieval_rate']:.2f}")


# --------------------------------------------------------------------------- 9. train / eval / ask
def toy_world_or_none(args):
    """The toy world of data_dir when it has one and augmentation is on (renaming needs its entity lists)."""
    if not (args.augment_p or args.rl_augment_p) or not (Path(args.data_dir) / "world.json").is_file():
        return None
    from common.toy import load_world
    return load_world(args.data_dir)


def result_record(args, before_sft, before, after, steps, wall):
    """The result contract of the project (README / DESIGN: results.json)."""
    final = after or before
    return {"method": "smartrag", "mode": "train" if args.train else "eval", "preset": args.preset, "seed": args.seed,
            "model": args.model,
            "dataset": args.data_dir, "n_eval": final["n"],
            "before_sft": before_sft, "before": before, "after": final,
            "retrievals_per_question": final["retrievals"], "llm_calls_per_question": final["policy_calls"],
            "generated_tokens_per_question": final["generated_tokens"], "wall_s": round(wall, 1),
            "train_steps": steps, "args": asdict(args)}


def train(args):
    """SFT warm-up, PPO, evaluation before and after; --resume continues from output_dir/sft and output_dir/ppo."""
    start, out = time.time(), start_run(args, "smartrag")  # the run's folder; refuses a checkpoint without --resume
    accelerator = make_accelerator(args.report_to, out)
    out.mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(args.run_name, {k: "None" if v is None else v for k, v in asdict(args).items()})
    set_seed(args.seed)
    train_rows = sample_rows(load_split(args.data_dir, "train", args.question_types), args.n_train, args.seed)
    test_rows = load_split(args.data_dir, "test", args.question_types)[:args.n_eval]
    retriever = open_retriever(args.index, args.corpus, args.encoder)
    log = lambda record: append_metrics(out / "metrics.jsonl", record, accelerator.is_main_process)
    world = toy_world_or_none(args)  # simplification: the toy world's renaming augmentation (header item 4)
    # ---- warm-up SFT (skipped when a finished SFT checkpoint exists)
    sft_dir, steps = out / "sft", {"sft": 0, "ppo": 0}
    if (state := load_state(sft_dir)) is not None:  # resume: the warm-up is done
        args_model, args.model = args.model, str(sft_dir)
        policy, tokenizer, tag_ids = load_policy(args, accelerator.device)
        args.model = args_model
        before_sft, steps["sft"] = state["before_sft"], state["steps"]
    else:
        policy, tokenizer, tag_ids = load_policy(args, accelerator.device)
        if args.base_pretrain_steps:  # simplification: a toy base model that knows the popular facts (header item 4)
            policy = pretrain_toy_base(accelerator, policy, tokenizer, tag_ids, train_rows, args)
        with accelerator.autocast():
            before_sft = evaluate_both(policy, tokenizer, retriever, test_rows, args, tag_ids,
                                       out / "predictions_raw.jsonl")
        accelerator.print(f"raw start | {brief(before_sft)}")
        examples, known = build_warmup(train_rows, retriever, args)
        accelerator.print(f"warm-up: {len(examples)} pairs from {len(train_rows)} questions ({args.initial_policy}; "
                          f"base model knows {known:.2f})")
        policy, steps["sft"] = sft(accelerator, policy, tokenizer, tag_ids, examples, args, world)
        if accelerator.is_main_process:
            save_checkpoint(sft_dir, policy, tokenizer, {"before_sft": before_sft, "steps": steps["sft"],
                                                         "data_dir": args.data_dir, "args": asdict(args)})
    with accelerator.autocast():
        before = evaluate_both(policy, tokenizer, retriever, test_rows, args, tag_ids, out / "predictions_sft.jsonl")
    accelerator.print(f"after SFT | {brief(before)}")
    log({"stage": "sft", "eval": before})
    accelerator.log({f"eval/{k}": v for k, v in before.items() if isinstance(v, float)}, step=0)
    # ---- PPO [§3.2]: policy + value model trained, reference frozen
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    model = PolicyAndValue(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.ppo_lr, weight_decay=1e-6)  # impl: wd 1e-6
    ppo_dir, beta, first = out / "ppo", args.kl_init, 0
    if (ppo_state := load_state(ppo_dir)) is not None:  # resume
        saved = torch.load(ppo_dir / "policy_and_value.pt", map_location="cpu", weights_only=True)
        if unexpected := model.load_state_dict(saved, strict=False).unexpected_keys:  # holds the trained weights only
            raise SystemExit(f"{ppo_dir}: policy_and_value.pt does not fit this model ({unexpected[:3]} ...)")
        optimizer.load_state_dict(torch.load(ppo_dir / "optimizer.pt", map_location="cpu", weights_only=True))
        beta, first = ppo_state["beta"], ppo_state["iteration"]
        steps["ppo"] = first
        accelerator.print(f"resumed PPO at iteration {first}")
    model, optimizer = accelerator.prepare(model, optimizer)
    rng = random.Random(args.seed * 1000 + accelerator.process_index)
    if ppo_state and len(ppo_state["rng"]) == accelerator.num_processes:  # draw on as the uninterrupted run would
        set_rng_states(ppo_state["rng"][accelerator.process_index], rng)
    after = None
    for it in range(first, args.ppo_iterations):
        t0, episodes = time.time(), []
        policy_now = accelerator.unwrap_model(model).policy
        model.eval()  # rollouts without dropout and with the KV cache; ppo_iteration switches to train mode
        while not episodes or sum(len(t["action_ids"]) for e in episodes for t in e["turns"]) < args.rollout_tokens:
            rows = rng.sample(train_rows, min(args.rollout_batch, len(train_rows)))
            # simplification: toy-world renaming of PPO episodes (header item 4)
            rows = [renamed_row(r, world, rng) if world and rng.random() < args.rl_augment_p else r for r in rows]
            with accelerator.autocast():
                episodes += rollout(policy_now, tokenizer, retriever, rows, args, tag_ids, greedy=False,
                                    seed=args.seed * 100_003 + it * 97 + len(episodes) + accelerator.process_index)
        stats = ppo_iteration(accelerator, model, ref, optimizer, tokenizer, episodes, beta, args)
        if args.kl_adaptive:
            beta = update_kl_coef(beta, stats["rollout/kl"], args.kl_target)  # after each rollout (impl)
        returns = [discounted_return([t["reward"] for t in e["turns"]], 1.0) for e in episodes]
        stats |= {"iteration": it + 1, "rollout/return": sum(returns) / len(returns), "charts/kl_coef": beta,
                  "rollout/retrieval_rate": sum(any(t["kind"] == "retrieve" for t in e["turns"]) for e in episodes) / len(episodes),
                  "charts/seconds": time.time() - t0}
        log(stats)
        accelerator.log(stats, step=it + 1)
        accelerator.print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
        steps["ppo"] = it + 1
        if (it + 1) % args.eval_every == 0 or it + 1 == args.ppo_iterations:
            accelerator.wait_for_everyone()
            unwrapped, rngs = accelerator.unwrap_model(model), gather_object([rng_states(rng)])  # every process's
            trained = {n for n, p in unwrapped.named_parameters() if p.requires_grad}  # never the frozen LoRA base
            if accelerator.is_main_process:
                state = {"beta": beta, "iteration": it + 1, "data_dir": args.data_dir, "args": asdict(args),
                         "rng": rngs}
                save_checkpoint(ppo_dir, unwrapped.policy, tokenizer, state, {
                    "policy_and_value.pt": {k: v for k, v in unwrapped.state_dict().items() if k in trained},
                    "optimizer.pt": optimizer.state_dict()})
    policy = accelerator.unwrap_model(model).policy
    with accelerator.autocast():
        after = evaluate_both(policy, tokenizer, retriever, test_rows, args, tag_ids, out / "predictions_ppo.jsonl")
    accelerator.print(f"after PPO | {brief(after)}")
    log({"stage": "ppo", "eval": after})
    accelerator.log({f"eval/{k}": v for k, v in after.items() if isinstance(v, float)}, step=steps["ppo"])
    accelerator.end_training()
    write_results(out, result_record(args, before_sft, before, after, steps, time.time() - start), accelerator.is_main_process)


def run_eval(args):
    """Evaluate --model (a checkpoint folder, or the untrained start) on the test split."""
    start, out = time.time(), Path(args.output_dir)
    refuse_training_results(out)
    accelerator = make_accelerator()
    out.mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)
    rows = load_split(args.data_dir, "test", args.question_types)[:args.n_eval]  # a bad data file fails first
    policy, tokenizer, tag_ids = load_policy(args, accelerator.device)
    with accelerator.autocast():
        retriever = open_retriever(args.index, args.corpus, args.encoder)
        result = evaluate_both(policy, tokenizer, retriever, rows, args, tag_ids, out / "predictions_eval.jsonl")
    accelerator.print(f"eval | {brief(result)}")
    write_results(out, result_record(args, None, result, None, {"sft": 0, "ppo": 0}, time.time() - start), accelerator.is_main_process)


def ask(args):
    """One question through Algorithm 1 with the greedy (threshold) policy, printing every step."""
    policy, tokenizer, tag_ids = load_policy(args, make_accelerator().device)
    if unknown := unknown_words(tokenizer, args.ask):
        print(f"warning: words the model's tokenizer does not know (read as <unk>): {' '.join(unknown)}")
    row = {"id": "ask", "question": args.ask, "golden_answers": [""], "metadata": {}}
    episode = rollout(policy, tokenizer, open_retriever(args.index, args.corpus, args.encoder), [row], args, tag_ids, greedy=True, seed=args.seed)[0]
    for n, turn in enumerate(episode["turns"]):
        print(f"step {n}: {turn['kind']} | {turn['text']}" + (" (answer forced at the quota)" if turn["forced_ids"] else ""))
        if n < len(episode["observations"]):
            print(f"  observation: {episode['observations'][n]}")
    print(f"answer: {episode['answer']}")


def main(argv=None):
    """Parse the flags, fill the preset, dispatch on the mode."""
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=argv)
    if args.ask and args.model is None:
        raise SystemExit("--ask needs --model: a trained checkpoint (e.g. runs/<run_name>/ppo after --train); "
                         "the untrained start answers at random")
    if args.data_dir is None and args.model and (state := load_state(args.model)):
        args.data_dir = state.get("data_dir")  # a checkpoint remembers its world (tokenizer, reader, corpus)
    apply_preset(args)
    if args.train:
        train(args)
    elif args.eval:
        run_eval(args)
    elif args.ask:
        ask(args)
    else:
        raise SystemExit("choose a mode: --train, --eval or --ask \"question\" (see --help)")


if __name__ == "__main__":
    run_main(main)  # a user's mistake (bad file, missing field) ends in one line, not a traceback
