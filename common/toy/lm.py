"""Tiny trainable models for the toy world: a word-level tokenizer over one world's vocabulary and a small Qwen2 LM.

    model, tokenizer = load_toy_lm("toy-lm", world="data/toy")          # 2 layers, hidden 128: about 0.6M parameters
    model, tokenizer = load_toy_lm("toy-lm:layers=4,hidden=256", world=args.data_dir, extra_tokens=("[Search]",))

The vocabulary is the world's (its names, years, template words and the format words), so a model is built for the
world it is trained on; `save_pretrained` keeps its tokenizer, so a checkpoint remembers its world's vocabulary.
Built offline from a config in well under a second, seeded, saved and loaded like any hub model
(`save_pretrained` / `AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`).
Tokenizer: lowercase, split on white space and punctuation, one token per word (every toy name and year is one
token, anything else is <unk>); `extra_tokens` are matched verbatim before that (case kept, never split) and are not
special, so decoding keeps them. Special tokens: <pad> <eos> <unk> <system> <user> <assistant>. Chat template:
"<user> {content} <eos> ... <assistant>" (each message is "<role> content <eos>"; a reply ends with <eos>).
This module imports the toy world (common.toy); common.models reaches it lazily for the "toy-lm" name.
"""

import re
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from common.toy.world import CHAINS, COMPARISONS, DEFAULT_WORLD, FORMAT_WORDS, HATNOTE, RELATIONS, load_world

SPECIALS = ["<pad>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
DEFAULT_SPEC = dict(layers=2, hidden=128, heads=4, kv_heads=4, intermediate=512, max_positions=1024, tie=1)


def toy_vocabulary(world):
    """Sorted words of the toy world: names, years, template words and the format words (no special tokens)."""
    words = set(world["types"]) | set(FORMAT_WORDS)
    lo, hi = world["year_range"]
    words |= {str(y) for y in range(lo, hi + 1)}
    templates = [s for spec in RELATIONS.values() for s in spec[2:]] + list(CHAINS.values())
    templates += list(COMPARISONS.values()) + [HATNOTE]
    words |= {w for t in templates for w in re.findall(r"[a-z0-9]+|[^\sa-z0-9{}]", t)}
    return sorted(words)


def build_tokenizer(world, extra_tokens=()):
    """A PreTrainedTokenizerFast (left padding, chat template) over the toy vocabulary plus extra_tokens."""
    vocab = {w: i for i, w in enumerate(SPECIALS + [w for w in toy_vocabulary(world) if w not in SPECIALS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra_tokens if t not in vocab])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[3:],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    # impl: AutoTokenizer (transformers 5) forces Qwen2Tokenizer (byte-level BPE) on a folder whose config.json says
    # qwen2, unless tokenizer_config.json has an auto_map; without trust_remote_code this auto_map only makes
    # AutoTokenizer honour "tokenizer_class" (the generic tokenizers backend), so the word-level tokenizer loads back.
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}
    return tokenizer


def parse_spec(spec):
    """'toy-lm' or 'toy-lm:layers=2,hidden=128,...' -> dict of DEFAULT_SPEC keys (ints)."""
    name, _, options = str(spec).partition(":")
    if name != "toy-lm":
        raise ValueError(f"not a toy model spec: {spec!r} (expected 'toy-lm' or 'toy-lm:key=value,...')")
    out = dict(DEFAULT_SPEC)
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULT_SPEC or not value.isdigit():
            raise ValueError(f"bad toy model option {item!r} in {spec!r}; keys: {', '.join(DEFAULT_SPEC)} (integers)")
        out[key] = int(value)
    return out


def load_toy_lm(spec="toy-lm", dtype=None, device=None, extra_tokens=(), seed=0, world=DEFAULT_WORLD):
    """(model, tokenizer): a randomly initialised (seeded) Qwen2ForCausalLM with tied embeddings and the tokenizer of
    `world` (a world folder or a loaded world). The committed world by default, for tests and benchmarks only: a
    method reaches this through common.models.load_model_and_tokenizer, which needs the world (LoRA is added there)."""
    options = parse_spec(spec)
    world = load_world(str(world)) if isinstance(world, (str, Path)) else world
    tokenizer = build_tokenizer(world, extra_tokens)
    tokenizer.model_max_length = options["max_positions"]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=options["hidden"],
        num_hidden_layers=options["layers"],
        num_attention_heads=options["heads"],
        num_key_value_heads=options["kv_heads"],
        intermediate_size=options["intermediate"],
        max_position_embeddings=options["max_positions"],
        tie_word_embeddings=bool(options["tie"]),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if device is not None:
        model = model.to(device)
    return model, tokenizer
