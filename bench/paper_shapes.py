"""Step time and memory of the paper presets' model shapes: random weights from a config, on one GPU.

    python bench/paper_shapes.py --method smartrag --shape llama2-7b        # SmartRAG's paper preset (LoRA r16)
    python bench/paper_shapes.py --method c3po --shape qwen2-0.5b           # C-3PO's proxy (full fine-tuning)
    python bench/paper_shapes.py --method c3po --shape qwen2-1.5b
    python bench/paper_shapes.py --method sparkle --shape qwen2.5-3b --steps 2   # SPARKLE's proxy and critic (H200)
    python bench/paper_shapes.py --method tearag --shape llama3-8b --steps 2     # TeaRAG's policy (LoRA r8)
    python bench/paper_shapes.py --method tearag --shape qwen2.5-14b --steps 2
    python bench/paper_shapes.py --method sparcrag --shape qwen2.5-7b --steps 2  # SPARC-RAG's backbone (LoRA r16)
    python bench/paper_shapes.py --method smartrag --shape tiny --steps 1   # the same code path on CPU, in seconds
    python bench/paper_shapes.py --method smartrag --shape llama2-7b --method_flags="--gradient_checkpointing False"

What runs is the method file's own code with its paper preset, not a copy of it:
- smartrag: `load_policy` (LoRA, gradient checkpointing of the paper preset), `rollout` of `--batch` questions
  (default: the preset's 64) through Algorithm 1 (a threshold of -1 makes every episode retrieve at its first turn,
  so each runs both turns of the quota; decoding is greedy, the paper's rollouts sample: the same cost per token),
  then `ppo_iteration` (scoring with the policy, value model and reference, then the PPO minibatches).
- c3po: `load_proxy`, one batched proxy `generate` call over `--nodes` agent prompts (one tree depth of a rollout),
  then `ppo_update` (scoring, whitening, micro-batched PPO of the policy and the critic) on `--samples` node samples.
- sparkle: `load_proxy` twice (the policy, and the base proxy under the critic's `ValueModel`, --critic_init base),
  fp32 master weights under `runs.make_accelerator` (bf16 autocast on a GPU); one `proxy_actor` call over `--nodes`
  Knowledge Integration prompts (the `--n_triples` 20 candidate triples of the preset), then `ppo_update` on
  `--samples` node samples (default 128; a rollout of 64 questions yields far more). 3B policy, reference and critic
  with fp32 Adam hold about 110 GB before activations: an H200 (139 GB), not an H100.
- tearag: `load_policy` (LoRA r8 on q/k/v/o over a bf16 base, fp32 adapters), `rollout` of the preset's R = 8
  sampled paths for each of `--batch` questions (default: the preset's 64), which random weights end after one
  step (one generate call of 8 x batch paths), then one `dpo_round` (its reference log-probs from the model at the
  round's start, then one AdamW step of DPO + eta SFT) on the preset's 16 pairs of paths: the prompt, then
  `--path_steps` steps of `--new_tokens` generated tokens each followed by a `reference_block` of k_f = 5 items
  (2 chunks of `--passage_tokens` words, 3 triplets; masked), then a final answer.
- sparcrag: `load_policy` (bf16 base without a warm-up), `sparc_rag` for one round of W = 2 branches of `--batch`
  questions (default 64) with every role played by the backbone (--llm policy): six generate calls (rewrite, update,
  answer, evaluate, select, merge); after the rounds, `dpo_train` (LoRA r16 added, reference: the adapter-disabled
  model) on `--steps` x 16 pairs built from the rounds' rewriter and evaluator prompts and outputs, one epoch: one
  optimizer step per timed step (the first one includes adding LoRA).
Random weights never stop early, so every action runs to its token cap (smartrag: the preset's 50; the others
`--new_tokens`, default 128, since the presets' caps (c3po 2048, sparkle 160, tearag 512, sparcrag 600) would time
outputs longer than the trained models write). The tokenizer is the toy world's word-level one (one token per
word) and the retrievers return synthetic passages of `--passage_tokens` tokens (wiki-18 passages are about 100
words, 130-150 subword tokens): the lengths are what the figures depend on, and the script prints them. No network:
the configs are written below and the weights are random.

Each step line also gives the decode figures: the generated tokens of the step's generate calls, their wall time
and tokens/s, and the bound of decoding by weight reads: tokens / sum over calls of (its decode steps x
decode_weight_gb / `--hbm_tb_s`), i.e. batch x bandwidth / weight bytes for one call whose rows all run to the cap.
decode_weight_gb counts every parameter of the generating model at its stored dtype (an fp32 weight under bf16
autocast is read as fp32, then cast), less an untied input embedding (a step reads only its rows); KV-cache reads
are not in the bound. `--hbm_tb_s`: 4.8 for an H200 (the default), 3.35 for an H100 SXM.
A CUDA out-of-memory error prints one line with the stage and the peak memory, and exits with status 1.
Figures go to docs/benchmarks.md with the machine they were measured on.
"""

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault(
    "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
)  # without it C-3PO 1.5B ran out (fragmentation)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

import c3po  # noqa: E402
import smartrag  # noqa: E402
import sparcrag  # noqa: E402
import sparkle  # noqa: E402
import tearag  # noqa: E402
from common import runs  # noqa: E402
from common.toy import DEFAULT_WORLD, RenamingEnv, load_world  # noqa: E402
from common.toy.lm import build_tokenizer, toy_vocabulary  # noqa: E402


def shape(config_class, hidden, intermediate, layers, heads, kv_heads, vocab, **extra):
    return config_class, dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        **extra,
    )


QWEN = dict(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
LLAMA3 = dict(max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
SHAPES = {  # the published configs of the paper presets' models: hidden, intermediate, layers, heads, kv heads, vocab
    # SmartRAG's policy, LLaMA-2-7B; C-3PO's proxy, Qwen2-0.5B / 1.5B
    "llama2-7b": shape(LlamaConfig, 4096, 11008, 32, 32, 32, 32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "qwen2-0.5b": shape(Qwen2Config, 896, 4864, 24, 14, 2, 151936, **QWEN, tie_word_embeddings=True),
    "qwen2-1.5b": shape(Qwen2Config, 1536, 8960, 28, 12, 2, 151936, **QWEN, tie_word_embeddings=True),
    # SPARKLE's proxy, Qwen2.5-3B-Instruct; SPARC-RAG's backbone, Qwen2.5-7B-Instruct
    "qwen2.5-3b": shape(Qwen2Config, 2048, 11008, 36, 16, 2, 151936, **QWEN, tie_word_embeddings=True),
    "qwen2.5-7b": shape(Qwen2Config, 3584, 18944, 28, 28, 4, 152064, **QWEN, tie_word_embeddings=False),
    # TeaRAG's policies, Qwen2.5-14B-Instruct and Meta-Llama-3-8B-Instruct
    "qwen2.5-14b": shape(Qwen2Config, 5120, 13824, 48, 40, 8, 152064, **(QWEN | dict(rms_norm_eps=1e-5))),
    "llama3-8b": shape(LlamaConfig, 4096, 14336, 32, 32, 8, 128256, **LLAMA3),
    # the same code paths on CPU, in seconds
    "tiny": shape(LlamaConfig, 64, 128, 2, 4, 4, 4096, max_position_embeddings=4096),
}


def random_model(shape, tokenizer, device, dtype):
    """A causal LM of the shape with random weights, built on the device (no hub, no CPU copy of the weights)."""
    config_class, kw = SHAPES[shape]
    config = config_class(
        **kw, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
    )
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"the toy tokenizer ({len(tokenizer)} tokens) does not fit the {shape} vocabulary")
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


class SyntheticRetriever:
    """search(queries, k) -> k passages per query, each `tokens` toy words long (one token per word)."""

    def __init__(self, words, tokens, seed=0):
        self.words, self.tokens, self.rng = words, tokens, random.Random(seed)

    def search(self, queries, k):
        text = lambda: " ".join(self.rng.choice(self.words) for _ in range(self.tokens))
        return [
            [{"id": f"{i}", "title": self.rng.choice(self.words), "text": text()} for i in range(k)] for _ in queries
        ]


def patched_loader(model, tokenizer):
    """Stand-in for common.models.load_model_and_tokenizer inside the method file: the random model of this script."""
    return lambda name_or_path, dtype=None, **kw: (model, tokenizer)


def building_loader(shape, tokenizer, device):
    """Stand-in for common.models.load_model_and_tokenizer that builds a random model of the shape in the dtype the
    method file's loader asks for (fp32 when it names none), on the device, at each call."""
    return lambda name_or_path, dtype=None, **kw: (
        random_model(shape, tokenizer, device, dtype or torch.float32),
        tokenizer,
    )


def memory_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_weight_bytes(model):
    """Bytes of the weights one decode step reads: every parameter at its stored dtype (an fp32 weight under bf16
    autocast is read as fp32, then cast), less an untied input embedding (a decode step reads only its rows)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding)


class GenerateLog:
    """Wraps a method module's `generate` (common.llm.generate): per call its batch, its decode steps (the longest
    output), the tokens it returned, its wall time and the weight bytes of its model."""

    def __init__(self, module):
        self.calls, self.inner, self.bytes = [], module.generate, {}
        module.generate = self

    def __call__(self, model, tokenizer, prompts, max_new_tokens, **kw):
        sync()
        t0 = time.perf_counter()
        gen = self.inner(model, tokenizer, prompts, max_new_tokens, **kw)
        sync()
        seconds, lengths = time.perf_counter() - t0, [len(ids) for ids in gen.token_ids]
        if id(model) not in self.bytes:
            self.bytes[id(model)] = decode_weight_bytes(model)
        call = dict(batch=len(prompts), steps=max(lengths, default=0), tokens=sum(lengths), seconds=seconds)
        self.calls.append(call | {"weight_bytes": self.bytes[id(model)]})
        return gen

    def take(self, hbm_tb_s):
        """The decode figures of the calls since the last take."""
        calls, self.calls = self.calls, []
        tokens, seconds = sum(c["tokens"] for c in calls), sum(c["seconds"] for c in calls)
        bound_s = sum(c["steps"] * c["weight_bytes"] for c in calls) / (hbm_tb_s * 1e12)
        return dict(
            generate_calls=len(calls),
            generate_batches=[c["batch"] for c in calls],
            generated_tokens=tokens,
            generate_s=round(seconds, 2),
            generate_tok_s=round(tokens / seconds, 1) if seconds else None,
            decode_weight_gb=round(max((c["weight_bytes"] for c in calls), default=0) / 1e9, 3),
            bound_tok_s=round(tokens / bound_s, 1) if bound_s else None,
        )


def question_rows(words, n, seed=0):
    """n synthetic FlashRAG rows with questions of the toy world's words."""
    rng = random.Random(seed)
    return [
        {
            "id": str(i),
            "question": "what is the birthplace of " + " ".join(rng.choice(words) for _ in range(6)) + " ?",
            "golden_answers": [rng.choice(words)],
            "metadata": {},
        }
        for i in range(n)
    ]


def bench_smartrag(opts, accelerator, tokenizer, words, dtype, out):
    (args,) = runs.flag_parser(smartrag.Args).parse_args_into_dataclasses(
        args=[
            "--preset",
            "paper",
            "--threshold",
            "-1",
            "--num_beams",
            "1",
            "--seed",
            "0",
            *shlex.split(opts.method_flags),
        ]
    )
    smartrag.apply_preset(args)
    args.rollout_batch = opts.batch or args.rollout_batch
    model = random_model(opts.shape, tokenizer, accelerator.device, dtype)
    smartrag.load_model_and_tokenizer = patched_loader(model, tokenizer)
    policy, tokenizer, tag_ids = smartrag.load_policy(args, accelerator.device)
    ref = smartrag.copy.deepcopy(policy).eval().requires_grad_(False)
    wrapped = smartrag.PolicyAndValue(policy)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.ppo_lr, weight_decay=1e-6)
    wrapped, optimizer = accelerator.prepare(wrapped, optimizer)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    env = RenamingEnv(SyntheticRetriever(words, opts.passage_tokens))
    rows = question_rows(words, args.rollout_batch)
    log = GenerateLog(smartrag)
    out |= dict(
        lora_r=args.lora_r,
        gradient_checkpointing=args.gradient_checkpointing,
        trainable_params=trainable,
        questions=len(rows),
        ppo_batch_size=args.ppo_batch_size,
    )
    for step in range(opts.steps):
        sync()
        t0 = time.perf_counter()
        wrapped.eval()
        out["stage"] = "rollout"
        episodes = smartrag.rollout(
            accelerator.unwrap_model(wrapped).policy, tokenizer, env, rows, args, tag_ids, greedy=True, seed=step
        )
        sync()
        t1 = time.perf_counter()
        out["stage"] = "ppo"
        stats = smartrag.ppo_iteration(accelerator, wrapped, ref, optimizer, tokenizer, episodes, args.kl_init, args)
        sync()
        t2 = time.perf_counter()
        seqs = smartrag.sequences_of(episodes)
        out["steps"].append(
            dict(
                rollout_s=round(t1 - t0, 2),
                ppo_s=round(t2 - t1, 2),
                sequences=len(seqs),
                mean_sequence_tokens=round(sum(len(s["ids"]) for s in seqs) / len(seqs), 1),
                turns_per_episode=len(seqs) / len(episodes),
                policy_loss=round(stats["losses/policy"], 4),
                peak_gib=round(memory_gib(), 1),
            )
            | log.take(opts.hbm_tb_s)  # generated_tokens: every action token of the rollout's generate calls
        )
        print(json.dumps(out["steps"][-1]), flush=True)
    return out


def bench_c3po(opts, accelerator, tokenizer, words, dtype, out):
    (args,) = runs.flag_parser(c3po.Args).parse_args_into_dataclasses(
        args=["--preset", "paper", "--seed", "0", *shlex.split(opts.method_flags)]
    )
    c3po.apply_preset(args)
    args.max_new_tokens = opts.new_tokens
    model = random_model(opts.shape, tokenizer, accelerator.device, dtype)
    c3po.load_model_and_tokenizer = patched_loader(model, tokenizer)
    policy, tokenizer = c3po.load_proxy(args, accelerator.device)
    ref = c3po.copy.deepcopy(policy).eval().requires_grad_(False)
    value = c3po.ValueModel(policy)
    optimizers = [
        torch.optim.Adam(m.parameters(), lr=lr, betas=(0.9, 0.95))
        for m, lr in ((policy, args.policy_lr), (value, args.value_lr))
    ]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in optimizers]
    policy, value, *optimizers = accelerator.prepare(policy, value, *optimizers)
    rng = random.Random(0)
    passages = SyntheticRetriever(words, opts.passage_tokens).search(["q"], args.top_k)[0]
    # an Information Filter prompt over top_k documents: the longest prompt a tree depth asks for
    prompt = c3po.TEMPLATES[args.templates]["filter_direct"].format(
        question="what is the birthplace of velbo ?", documents=c3po.format_documents(passages)
    )
    requests = [c3po.Request({}, 0, "filter", 1, prompt, {}, 1) for _ in range(opts.nodes)]
    prompt_ids = c3po.encode_prompts(tokenizer, [prompt], args.system_prompt)[0]
    log = GenerateLog(c3po)
    out |= dict(
        trainable_params=sum(p.numel() for p in policy.parameters()),
        nodes=opts.nodes,
        prompt_tokens=len(prompt_ids),
        new_tokens=opts.new_tokens,
        samples=opts.samples,
        micro_batch_size=args.micro_batch_size,
        ppo_batch_size=args.ppo_batch_size,
    )
    act = c3po.proxy_actor(accelerator.unwrap_model(policy), tokenizer, args, greedy=False)
    pad = tokenizer.pad_token_id
    return ppo_steps(
        opts,
        out,
        log,
        lambda step: node_samples([a[0] for a in act(requests, seed=step)], opts.samples, rng, "filter"),  # n = 1
        lambda samples: c3po.ppo_update(accelerator, policy, value, ref, optimizers, schedulers, samples, pad, args),
    )


def ppo_steps(opts, out, log, sample, update):
    """The timed steps of a PPO bench: sample(step) generates a tree depth's node samples, update(samples) runs PPO."""
    for step in range(opts.steps):
        sync()
        t0 = time.perf_counter()
        out["stage"] = "generate"
        samples = sample(step)
        sync()
        t1 = time.perf_counter()
        out["stage"] = "ppo"
        stats = update(samples)
        sync()
        t2 = time.perf_counter()
        out["steps"].append(
            dict(
                generate_s=round(t1 - t0, 2),
                ppo_s=round(t2 - t1, 2),
                sample_tokens=sum(len(s["ids"]) for s in samples),
                policy_loss=round(stats["losses/policy"], 4),
                peak_gib=round(memory_gib(), 1),
            )
            | log.take(opts.hbm_tb_s)
        )
        print(json.dumps(out["steps"][-1]), flush=True)
    return out


def node_samples(acted, n, rng, agent):
    """n node samples of the lengths a depth produces: its prompt + a sampled action, credits 0 or 1 at random."""
    samples = []
    for _ in range(n):
        _, ids, action = rng.choice(acted)
        samples.append(
            dict(
                ids=ids + action,
                credit=float(rng.random() < 0.5),
                agent=agent,
                forced=0,
                loss_mask=[0] * len(ids) + [1] * len(action),
            )
        )
    return samples


def bench_sparkle(opts, accelerator, tokenizer, words, out):
    (args,) = runs.flag_parser(sparkle.Args).parse_args_into_dataclasses(
        args=["--preset", "paper", "--seed", "0", *shlex.split(opts.method_flags)]
    )
    sparkle.apply_preset(args)
    args.max_new_tokens = opts.new_tokens
    device = accelerator.device
    sparkle.load_model_and_tokenizer = building_loader(opts.shape, tokenizer, device)
    policy, tokenizer = sparkle.load_proxy(args, device)  # fp32 master weights
    # as sparkle.train: the reference is the (SFT) proxy, frozen; the critic's backbone per --critic_init
    ref = sparkle.copy.deepcopy(policy).eval().requires_grad_(False)
    value = sparkle.ValueModel(policy if args.critic_init == "sft" else sparkle.load_proxy(args, device)[0])
    optimizers = [
        torch.optim.Adam(m.parameters(), lr=lr, betas=(0.9, 0.95))
        for m, lr in ((policy, args.policy_lr), (value, args.value_lr))
    ]
    schedule = lambda s: sparkle.cosine(s, args.ppo_iterations, max(1, int(0.03 * args.ppo_iterations)))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
    policy, value, *optimizers = accelerator.prepare(policy, value, *optimizers)
    tpl, rng = sparkle.TEMPLATES[args.templates], random.Random(0)
    # a Knowledge Integration prompt over the n_triples candidate triples of the retrieved documents [§D.3: 20]
    triple = lambda: (" ".join(rng.choice(words) for _ in range(3)), rng.choice(words), rng.choice(words))
    hits = SyntheticRetriever(words, opts.passage_tokens).search(["q"], args.n_triples)[0]
    candidates = [(h, " ".join(triple())) for h in hits]
    chain = ", ".join(f"<{h}; {r}; {t}>" for h, r, t in (triple(), triple()))
    user = tpl["ki"].format(
        candidates=sparkle.format_candidates(tpl, candidates),
        question="what is the birthplace of the director of velbo ?",
        chain=chain,
        query="who directed velbo ?",
    )
    requests = [sparkle.Request(None, "ki", (tpl.get("ki_system", ""), user)) for _ in range(opts.nodes)]
    prompt_ids = sparkle.encode_prompts(tokenizer, [(tpl.get("ki_system", ""), user)])[0]
    log = GenerateLog(sparkle)
    unwrapped = accelerator.unwrap_model(policy)
    out |= dict(
        trainable_params=sum(p.numel() for p in unwrapped.parameters()),
        critic_params=sum(p.numel() for p in accelerator.unwrap_model(value).parameters()),
        weight_dtype=str(next(unwrapped.parameters()).dtype),
        nodes=opts.nodes,
        prompt_tokens=len(prompt_ids),
        new_tokens=opts.new_tokens,
        samples=opts.samples,
        micro_batch_size=args.micro_batch_size,
        ppo_batch_size=args.ppo_batch_size,
    )
    act, pad = sparkle.proxy_actor(unwrapped, tokenizer, args, greedy=False), tokenizer.pad_token_id

    def sample(step):
        with accelerator.autocast():  # as sparkle.train's rollout
            return node_samples(act(requests, seed=step), opts.samples, rng, "ki")

    update = lambda samples: sparkle.ppo_update(
        accelerator, policy, value, ref, optimizers, schedulers, samples, pad, args
    )
    return ppo_steps(opts, out, log, sample, update)


class SyntheticTeaRAGSystem:
    """tearag.RetrievalSystem's retrieve(subqueries, entity_lists) -> k_f items per subquery: 2 chunks of `tokens`
    words and 3 triplets (random weights almost never ask for one; the DPO paths' reference blocks use it)."""

    def __init__(self, words, tokens, k_f, seed=0):
        self.words, self.tokens, self.k_f, self.rng = words, tokens, k_f, random.Random(seed)

    def retrieve(self, subqueries, entity_lists):
        w = lambda n: " ".join(self.rng.choice(self.words) for _ in range(n))
        chunk = lambda: {"kind": "chunk", "doc_id": "0", "title": w(2), "text": w(self.tokens)}
        triplet = lambda: {"kind": "triplet", "doc_id": "0", "head": w(2), "relation": w(1), "tail": w(2)}
        return [[chunk() if i < 2 else triplet() for i in range(self.k_f)] for _ in subqueries]


def bench_tearag(opts, accelerator, tokenizer, words, out):
    (args,) = runs.flag_parser(tearag.Args).parse_args_into_dataclasses(
        args=["--preset", "paper", "--seed", "0", *shlex.split(opts.method_flags)]
    )
    tearag.apply_preset(args)
    args.max_new_tokens = opts.new_tokens
    args.rollout_batch = opts.batch or args.rollout_batch
    device = accelerator.device
    tearag.load_model_and_tokenizer = building_loader(opts.shape, tokenizer, device)
    model, tokenizer = tearag.load_policy(args, device)  # bf16 base (GPU), fp32 LoRA r8 on q/k/v/o
    system = SyntheticTeaRAGSystem(words, opts.passage_tokens, args.k_f)
    rows = question_rows(words, args.rollout_batch)
    log = GenerateLog(tearag)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    etas = [float(x) for x in args.eta.split(",")]
    out |= dict(
        lora_r=args.lora_r,
        trainable_params=trainable,
        weight_dtype=str(model.get_input_embeddings().weight.dtype),
        questions=len(rows),
        paths=len(rows) * args.n_rollouts,
        new_tokens=args.max_new_tokens,
        dpo_batch_size=args.dpo_batch_size,
        micro_batch_size=args.micro_batch_size,
    )
    rng = random.Random(0)
    for step in range(opts.steps):
        sync()
        t0 = time.perf_counter()
        out["stage"] = "generate"
        model.eval()
        with accelerator.autocast():  # as tearag.train's sample_round: R sampled paths per question
            paths = tearag.rollout(model, tokenizer, system, rows, args, args.n_rollouts, False, seed=step)
        sync()
        t1 = time.perf_counter()
        paired = [rng.sample(paths, 2) for _ in range(args.dpo_batch_size)]
        make = lambda p: tearag_path(p, tokenizer, system, opts.path_steps, rng).sequence()  # noqa: E731
        pairs = [(make(a), make(b)) for a, b in paired]
        out["stage"] = "dpo"
        model, stats, _ = tearag.dpo_round(accelerator, model, tokenizer, pairs, etas[0], 1, args, rng)
        sync()
        t2 = time.perf_counter()
        out["steps"].append(
            dict(
                generate_s=round(t1 - t0, 2),
                dpo_s=round(t2 - t1, 2),
                prompt_tokens=len(paths[0].prompt),
                mean_path_tokens=round(sum(len(ids) for pair in pairs for ids, _ in pair) / len(pairs) / 2),
                dpo_loss=round(stats["losses/dpo"], 4),
                peak_gib=round(memory_gib(), 1),
            )
            | log.take(opts.hbm_tb_s)
        )
        print(json.dumps(out["steps"][-1]), flush=True)
    return out


def tearag_path(sampled, tokenizer, system, n_steps, rng):
    """A path of realistic length for the DPO pairs: the sampled path's prompt, then n_steps of its generated tokens
    (trained) and a reference block (masked), then a short final answer (trained)."""
    path = tearag.ReasoningPath(sampled.row, sampled.prompt)
    for _ in range(n_steps):
        path.append(sampled.ids, sampled.text, trained=True)
        block = tearag.reference_block(system.retrieve(["q"], [[]])[0])
        path.append(tokenizer(block, add_special_tokens=False)["input_ids"], block, trained=False)
    answer = "Summary: " + sampled.text[:200] + "\nFinal answer: " + rng.choice(["yes", "no"])
    path.append(tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], answer, True)
    return path


def bench_sparcrag(opts, accelerator, tokenizer, words, out):
    (args,) = runs.flag_parser(sparcrag.Args).parse_args_into_dataclasses(
        args=["--preset", "paper", *shlex.split(opts.method_flags)]
    )
    sparcrag.apply_preset(args)
    args.max_new_tokens = args.evaluator_max_tokens = opts.new_tokens
    args.dpo_epochs = 1
    device = accelerator.device
    sparcrag.load_model_and_tokenizer = building_loader(opts.shape, tokenizer, device)
    policy, tokenizer = sparcrag.load_policy(args, device)  # without a warm-up: a bf16 base on a GPU
    retriever = SyntheticRetriever(words, opts.passage_tokens)
    llm = None if args.llm == "policy" else sparcrag.make_llm(args.llm)
    ctx = sparcrag.make_ctx(policy, tokenizer, {"bm25": retriever, "dense": retriever}, llm, args)
    rows = question_rows(words, opts.batch or 64)
    log = GenerateLog(sparcrag)
    out |= dict(
        lora_r=args.lora_r,
        weight_dtype=str(policy.get_input_embeddings().weight.dtype),
        questions=len(rows),
        width=args.width,
        new_tokens=opts.new_tokens,
        dpo_batch_size=args.dpo_batch_size,
        micro_batch_size=args.micro_batch_size,
    )
    entries = []
    for step in range(opts.steps):  # the base model's rounds, then DPO (as sparcrag.train: pairs, then dpo_train)
        sync()
        t0 = time.perf_counter()
        out["stage"] = "generate"
        with accelerator.autocast():
            done = sparcrag.sparc_rag(rows, ctx, args.width, 1, early_exit=False, seed=step)
        sync()
        out["steps"].append(dict(generate_round_s=round(time.perf_counter() - t0, 2)) | log.take(opts.hbm_tb_s))
        entries += [e for run in done for e in run.trace if e["role"] in sparcrag.TRAINED]
    rng = random.Random(0)
    same_role = lambda e: [x for x in entries if x["role"] == e["role"] and x is not e] or [e]
    pairs = []
    for i in range(opts.steps * args.dpo_batch_size):  # a chosen and a rejected output of the same role's prompt
        e = entries[i % len(entries)]
        weight = args.lam if e["role"] == "evaluate" and i % 2 else 1.0
        rejected = rng.choice(same_role(e))["output"]
        pairs.append(
            {"role": e["role"], "prompt": e["prompt"], "weight": weight, "chosen": e["output"], "rejected": rejected}
        )
    times = []

    def timed_log(accelerator_, out_, record, step):  # the end of each dpo_train step
        sync()
        times.append((time.perf_counter(), record))

    out["stage"] = "dpo"
    sync()
    t0 = time.perf_counter()
    inner, sparcrag.runs.log_update = sparcrag.runs.log_update, timed_log
    try:
        with tempfile.TemporaryDirectory() as tmp:
            policy, n_steps = sparcrag.dpo_train(accelerator, policy, tokenizer, pairs, args, None, Path(tmp))
    finally:
        sparcrag.runs.log_update = inner
    lengths = [len(sparcrag.encode(tokenizer, p["prompt"], p[y])[0]) for p in pairs for y in ("chosen", "rejected")]
    starts = [t0] + [t for t, _ in times[:-1]]
    for line, start, (end, record) in zip(out["steps"], starts, times):
        line |= dict(
            dpo_s=round(end - start, 2),
            mean_pair_sequence_tokens=round(sum(lengths) / len(lengths)),
            dpo_loss=round(record["losses/dpo"], 4),
            peak_gib=round(memory_gib(), 1),
        )
        print(json.dumps(line), flush=True)
    out["trainable_params"] = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["smartrag", "c3po", "sparkle", "tearag", "sparcrag"], required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the first includes warm-up)")
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="questions per rollout (0: smartrag and tearag the presets' 64 (tearag: x R = 8 paths), sparcrag 64 "
        "(x W = 2 branches))",
    )
    parser.add_argument("--passage_tokens", type=int, default=130, help="tokens per retrieved passage")
    parser.add_argument("--nodes", type=int, default=256, help="c3po, sparkle: agent prompts in one generate call")
    parser.add_argument(
        "--new_tokens", type=int, default=128, help="c3po, sparkle, tearag, sparcrag: tokens per action"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=0,
        help="c3po, sparkle: node samples in one PPO update (0: c3po 1024, sparkle 128)",
    )
    parser.add_argument("--path_steps", type=int, default=2, help="tearag: retrieval steps of each DPO path")
    parser.add_argument("--hbm_tb_s", type=float, default=4.8, help="HBM bandwidth, TB/s (H200 4.8, H100 SXM 3.35)")
    parser.add_argument(
        "--method_flags",
        default="",
        help='flags of the method file, e.g. --method_flags="--gradient_checkpointing False"',
    )
    parser.add_argument("--json", default="", help="also write the figures to this file")
    opts = parser.parse_args()
    opts.samples = opts.samples or {"c3po": 1024, "sparkle": 128}.get(opts.method, 0)
    new = opts.method in ("sparkle", "tearag", "sparcrag")
    # the new methods: the method files' accelerator (bf16 autocast over fp32 master weights on a GPU); smartrag and
    # c3po: the bf16 weights of the figures in docs/benchmarks.md
    accelerator = runs.make_accelerator() if new else Accelerator(cpu=not torch.cuda.is_available())
    dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32
    world = load_world(DEFAULT_WORLD)
    tags = {"smartrag": (smartrag.ANSWER_TAG, smartrag.RETRIEVE_TAG), "tearag": (tearag.REF_OPEN, tearag.REF_CLOSE)}
    tokenizer = build_tokenizer(world, tags.get(opts.method, ()))
    if opts.method == "tearag":  # its format words now, so that load_policy resizes no embedding of the shape
        tearag.add_format_tokens(SimpleNamespace(resize_token_embeddings=lambda n: None), tokenizer)
    words = [w for w in toy_vocabulary(world) if w.isalpha()]
    out = dict(method=opts.method, shape=opts.shape, steps=[], stage="build")
    run = dict(smartrag=bench_smartrag, c3po=bench_c3po, sparkle=bench_sparkle, tearag=bench_tearag)
    run |= dict(sparcrag=bench_sparcrag)
    out |= dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        mixed_precision=accelerator.mixed_precision,
        hbm_tb_s=opts.hbm_tb_s,
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
    )
    if not new:
        out["dtype"] = str(dtype)
    try:
        if new:
            run[opts.method](opts, accelerator, tokenizer, words, out)
        else:
            run[opts.method](opts, accelerator, tokenizer, words, dtype, out)
    except torch.cuda.OutOfMemoryError:
        out |= dict(error="CUDA out of memory", peak_gib=round(memory_gib(), 1))
        total = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else float("nan")
        if opts.json:
            Path(opts.json).write_text(json.dumps(out, indent=1))
        print(json.dumps(out), flush=True)  # with the steps done (sparcrag: its rounds before DPO)
        raise SystemExit(
            f"CUDA out of memory: {opts.method} {opts.shape} in its {out['stage']} stage, peak {out['peak_gib']} GiB "
            f"allocated of {total:.1f} GiB (smaller --nodes, --samples, --batch, or --method_flags)"
        ) from None
    del out["stage"]
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}))
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
