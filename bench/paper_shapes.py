"""Step time and memory of the paper presets' model shapes: random weights from a config, bf16, on one GPU.

    python bench/paper_shapes.py --method smartrag --shape llama2-7b        # SmartRAG's paper preset (LoRA r16)
    python bench/paper_shapes.py --method c3po --shape qwen2-0.5b           # C-3PO's proxy (full fine-tuning)
    python bench/paper_shapes.py --method c3po --shape qwen2-1.5b
    python bench/paper_shapes.py --method smartrag --shape tiny --steps 1   # the same code path on CPU, in seconds
    python bench/paper_shapes.py --method smartrag --shape llama2-7b --method_flags="--gradient_checkpointing False"

What runs is the method file's own code, not a copy of it:
- smartrag: `load_policy` (LoRA, gradient checkpointing of the paper preset), `rollout` of `rollout_batch` questions
  through Algorithm 1 (a threshold of -1 makes every episode retrieve at its first turn, so each runs both turns of
  the quota; decoding is greedy, the paper's rollouts sample: the same cost per token), then `ppo_iteration`
  (scoring with the policy, value model and reference, then the PPO minibatches).
- c3po: `load_proxy`, one batched proxy `generate` call over `--nodes` agent prompts (one tree depth of a rollout),
  then `ppo_update` (scoring, whitening, micro-batched PPO of the policy and the critic) on `--samples` node samples.
Random weights never stop early, so every action runs to its token cap (smartrag: the preset's 50; c3po:
`--new_tokens`, since the preset's 2048 would only time runaway outputs). The tokenizer is the toy world's
word-level one (one token per word) and the retriever returns synthetic passages of `--passage_tokens` tokens
(wiki-18 passages are about 100 words, 130-150 subword tokens): the lengths are what the figures depend on, and the
script prints them. No network: the configs are written below and the weights are random.
Figures go to docs/benchmarks.md with the machine they were measured on.
"""

import argparse
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault(
    "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
)  # without it C-3PO 1.5B ran out (fragmentation)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig, Qwen2Config  # noqa: E402

import c3po  # noqa: E402
import smartrag  # noqa: E402
from common.toy import DEFAULT_WORLD, RenamingEnv, load_world  # noqa: E402
from common.toy_lm import build_tokenizer, toy_vocabulary  # noqa: E402

SHAPES = {  # the published configs of the paper presets' models (hidden sizes, layers, heads, vocabulary)
    "llama2-7b": (
        LlamaConfig,
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen2-0.5b": (
        Qwen2Config,
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        ),
    ),
    "qwen2-1.5b": (
        Qwen2Config,
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        ),
    ),
    "tiny": (
        LlamaConfig,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=4096,
            max_position_embeddings=4096,
        ),
    ),
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


def memory_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_smartrag(opts, accelerator, tokenizer, words, dtype):
    (args,) = HfArgumentParser(smartrag.Args).parse_args_into_dataclasses(
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
    env, rng = RenamingEnv(SyntheticRetriever(words, opts.passage_tokens)), random.Random(0)
    rows = [
        {
            "id": str(i),
            "question": "what is the birthplace of " + " ".join(rng.choice(words) for _ in range(6)) + " ?",
            "golden_answers": [rng.choice(words)],
            "metadata": {},
        }
        for i in range(args.rollout_batch)
    ]
    out = dict(
        method="smartrag",
        shape=opts.shape,
        lora_r=args.lora_r,
        gradient_checkpointing=args.gradient_checkpointing,
        trainable_params=trainable,
        questions=len(rows),
        ppo_batch_size=args.ppo_batch_size,
        steps=[],
    )
    for step in range(opts.steps):
        sync()
        t0 = time.perf_counter()
        wrapped.eval()
        episodes = smartrag.rollout(
            accelerator.unwrap_model(wrapped).policy, tokenizer, env, rows, args, tag_ids, greedy=True, seed=step
        )
        sync()
        t1 = time.perf_counter()
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
                generated_tokens=sum(sum(s["loss_mask"]) for s in seqs),
                turns_per_episode=len(seqs) / len(episodes),
                policy_loss=round(stats["losses/policy"], 4),
                peak_gib=round(memory_gib(), 1),
            )
        )
        print(json.dumps(out["steps"][-1]), flush=True)
    return out


def bench_c3po(opts, accelerator, tokenizer, words, dtype):
    (args,) = HfArgumentParser(c3po.Args).parse_args_into_dataclasses(
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
    requests = [dict(prompt=prompt, fixed=None, prefix="", n=1) for _ in range(opts.nodes)]
    prompt_ids = c3po.encode_prompts(tokenizer, [prompt], args.system_prompt)[0]
    out = dict(
        method="c3po",
        shape=opts.shape,
        trainable_params=sum(p.numel() for p in policy.parameters()),
        nodes=opts.nodes,
        prompt_tokens=len(prompt_ids),
        new_tokens=opts.new_tokens,
        samples=opts.samples,
        micro_batch_size=args.micro_batch_size,
        ppo_batch_size=args.ppo_batch_size,
        steps=[],
    )
    for step in range(opts.steps):
        sync()
        t0 = time.perf_counter()
        acted = c3po.proxy_actor(accelerator.unwrap_model(policy), tokenizer, args, greedy=False)(requests, seed=step)
        sync()
        t1 = time.perf_counter()
        samples = []
        for _ in range(opts.samples):  # node samples of the lengths a depth produces: its prompt + a sampled action
            _, ids, action = rng.choice(acted)[0]
            samples.append(
                dict(
                    ids=ids + action,
                    credit=float(rng.random() < 0.5),
                    agent="filter",
                    forced=0,
                    loss_mask=[0] * len(ids) + [1] * len(action),
                )
            )
        pad = tokenizer.pad_token_id
        stats = c3po.ppo_update(accelerator, policy, value, ref, optimizers, schedulers, samples, pad, args)
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
        )
        print(json.dumps(out["steps"][-1]), flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["smartrag", "c3po"], required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the first includes warm-up)")
    parser.add_argument("--batch", type=int, default=0, help="smartrag: questions per rollout (0: the preset's 64)")
    parser.add_argument("--passage_tokens", type=int, default=130, help="tokens per retrieved passage")
    parser.add_argument("--nodes", type=int, default=256, help="c3po: agent prompts in one generate call")
    parser.add_argument("--new_tokens", type=int, default=128, help="c3po: proxy tokens per action")
    parser.add_argument("--samples", type=int, default=1024, help="c3po: node samples in one PPO update")
    parser.add_argument(
        "--method_flags",
        default="",
        help='flags of the method file, e.g. --method_flags="--gradient_checkpointing False"',
    )
    parser.add_argument("--json", default="", help="also write the figures to this file")
    opts = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32
    world = load_world(DEFAULT_WORLD)
    tags = (smartrag.ANSWER_TAG, smartrag.RETRIEVE_TAG) if opts.method == "smartrag" else ()
    tokenizer = build_tokenizer(world, tags)
    words = [w for w in toy_vocabulary(world) if w.isalpha()]
    run = bench_smartrag if opts.method == "smartrag" else bench_c3po
    out = run(opts, accelerator, tokenizer, words, dtype)
    out |= dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        dtype=str(dtype),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
    )
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}))
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
