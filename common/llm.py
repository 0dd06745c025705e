"""Models and LLMs: load a causal LM (hub id or local folder, optional LoRA), batched generation, frozen-LLM clients.

`generate` is what rollouts use: one left-padded `model.generate` call per batch, returning the texts and the generated
token ids (PPO's `loss_mask` covers exactly those ids). `make_llm(spec)` gives a frozen LLM with one method,
`.chat(messages_lists, **sampling) -> list[str]`, behind two backends chosen by the spec string:
"hf:<name or folder>" a local transformers model, "http(s)://<host>/v1" any OpenAI-compatible chat endpoint
(vLLM, SGLang, ...; stdlib urllib, retries, a thread pool). `unknown_words` lists the words of a text that a
tokenizer can only read as its unk token. This module knows nothing of the toy world: common.models adds its
`toy-lm` models and `toy:<world>` reader, and method files load through there.
"""

import http.client
import json
import os
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, StoppingCriteriaList

from common.runs import TrainingTokens, evaluation

LLM_SPECS = '"hf:<model name or folder>", "http(s)://<host>/v1" (an OpenAI-compatible endpoint)'
# A checkpoint's generation_config.json may carry its own processors (Qwen2.5-Instruct: repetition_penalty=1.05).
# They are switched off so that samples follow exactly the distribution asked for (PPO recomputes its log-probs).
PLAIN_SAMPLING = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, min_p=None)
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names it and says why."""


class LLMRequestError(RuntimeError):
    """A request to an LLM endpoint failed (after the retries, where retrying made sense)."""


def load_model_and_tokenizer(
    name_or_path, dtype=None, device=None, lora=None, trust_remote_code=False, load_base=None
):
    """(model, tokenizer) from a hub id or a local folder; the tokenizer pads on the left; `lora` wraps it with peft.
    A LoRA folder loads the base model it names with `load_base` (default: this function; common.models passes its
    own, which also knows the toy world's base models) and its adapters, trainable."""
    name = str(name_or_path)
    local = (folder := Path(name).expanduser()).is_dir()
    path_like = len(folder.parts) > 2  # runs/x/ppo: a path, never a hub id (org/name)
    if not local and (name.startswith(("/", "./", "../", "~", ".\\")) or path_like):
        raise ModelLoadError(f"model folder {name!r} does not exist")
    source = str(folder) if local else name
    options = dict(local_files_only=local, trust_remote_code=trust_remote_code)
    try:
        tokenizer = tokenizer_class_for(folder if local else None).from_pretrained(source, **options)
        if local and (folder / "adapter_config.json").is_file():  # LoRA: the base it names, resized, then trainable
            from peft import PeftConfig, PeftModel  # adapters (added tokens' rows: saved with them, trainable tokens)

            base = PeftConfig.from_pretrained(folder).base_model_name_or_path
            model, _ = (load_base or load_model_and_tokenizer)(base, dtype, trust_remote_code=trust_remote_code)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            model = PeftModel.from_pretrained(model, folder, is_trainable=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, **options, **({"dtype": dtype} if dtype else {}))
    except (OSError, ValueError) as e:
        where = (
            "local folder" if local else "hub id (not a local folder; no network, HF_HUB_OFFLINE=1, or a wrong name?)"
        )
        reason = str(e).strip().split("\n")[0] or type(e).__name__
        raise ModelLoadError(f"cannot load model {name!r} as a {where}: {reason}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model if device is None else model.to(device)
    return (model if lora is None else add_lora(model, lora)), tokenizer


def tokenizer_class_for(folder):
    """PreTrainedTokenizerFast when a local folder's tokenizer_config.json names that class, else AutoTokenizer."""
    # transformers 5 loads the tokenizer of any qwen2 checkpoint as Qwen2Tokenizer, which rebuilds a byte-level BPE
    # from the vocabulary and silently breaks e.g. a word-level tokenizer.json; the class the folder names is honoured.
    if folder is None or not (config := folder / "tokenizer_config.json").is_file():
        return AutoTokenizer
    named = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    return PreTrainedTokenizerFast if named in ("TokenizersBackend", "PreTrainedTokenizerFast") else AutoTokenizer


def unknown_words(tokenizer, text):
    """The words of text (once each, in order) that the tokenizer maps to its unk token: [] for a tokenizer without
    one or one that never emits it (byte-level BPE). A toy-lm tokenizer reads a word outside its world as <unk>."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    if not tokenizer.is_fast:  # no offsets: test each white-space word on its own
        pieces = [w for w in text.split() if unk in tokenizer(w, add_special_tokens=False)["input_ids"]]
    else:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        pieces = [text[a:b].strip() for i, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]) if i == unk]
    return list(dict.fromkeys(p for p in pieces if p and p != tokenizer.unk_token))  # a typed "<unk>" is no word


def add_lora(model, lora):
    """The model wrapped by peft with LoRA adapters; `lora` is a peft LoraConfig or a dict of its arguments."""
    from peft import LoraConfig, get_peft_model

    config = lora if isinstance(lora, LoraConfig) else LoraConfig(**{"task_type": "CAUSAL_LM", **lora})
    return get_peft_model(model, config)


def backbone_of(model):
    """The transformer body of a causal LM (LoRA layers included), without its LM head: a critic's trunk."""
    model = (
        model.get_base_model() if hasattr(model, "get_base_model") else model
    )  # peft: the wrapped transformers model
    return model.base_model


@dataclass
class Generation:
    """The outputs of one batched generation, one entry per prompt."""

    texts: list[str]  # decoded without special tokens, ending with the first stop string (kept) if one appeared
    token_ids: list[list[int]]  # generated ids up to the EOS or the token completing the stop string; no padding
    # (a pad id that the model itself samples, possible only when pad is not an EOS id, is a real token and stays)
    prompt_ids: list[list[int]]  # the prompt ids, unpadded
    finished: list[bool]  # True when the row ended on EOS or a stop string, False when it ran out of max_new_tokens


def chat_prompts(tokenizer, messages_batch):
    """Prompt strings of {"role", "content"} message lists, through the chat template with the generation prompt."""
    return [
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for messages in messages_batch
    ]


def chat_generate(model, tokenizer, messages_batch, **gen_kwargs):
    """generate() on the chat-templated prompts of a batch of conversations."""
    return generate(model, tokenizer, chat_prompts(tokenizer, messages_batch), **gen_kwargs)


def as_list(stop):
    """Stop strings as a list (None, one string, or several)."""
    return [] if not stop else [stop] if isinstance(stop, str) else list(stop)


def left_pad(sequences, pad_id):
    """(input_ids, attention_mask) tensors of id lists padded on the left."""
    width = max(map(len, sequences))
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences])  # (B, T)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])  # (B, T)
    return input_ids, attention_mask


def right_pad(rows, pad):
    """(B, T) tensor of id, label or mask lists padded on the right with `pad`."""
    width = max(map(len, rows))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows])


def eos_ids_of(model, tokenizer):
    """Every id that ends a generation: the model's generation_config EOS ids and the tokenizer's EOS."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [configured]) | {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts,
    max_new_tokens,
    do_sample=True,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    stop=(),
    seed=None,
    num_beams=1,
):
    """Continue prompts (strings or id lists) in one left-padded model.generate call; a stop string ends a text."""
    if not prompts:
        return Generation([], [], [], [])
    stop = as_list(stop)
    text = isinstance(prompts[0], str)  # chat_prompts output already holds its special tokens
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"] if text else list(map(list, prompts))
    prompt_ids = fit_context(prompt_ids, model, max_new_tokens)
    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    do_sample = do_sample and num_beams == 1  # beam search is deterministic here
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else {}
    eos_ids = eos_ids_of(model, tokenizer)
    if seed is not None:
        torch.manual_seed(seed)  # seeds every device; under DDP pass a different seed per process
    stopping = StoppingCriteriaList([stop_criterion(tokenizer, stop, input_ids.shape[1])] if stop else [])
    # position ids follow attention_mask (cumsum - 1), so padding does not shift positions
    output = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        num_beams=num_beams,
        **sampling,
        **PLAIN_SAMPLING,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        stopping_criteria=stopping,
    )
    rows = [finish_row(ids, tokenizer, stop, eos_ids) for ids in output[:, input_ids.shape[1] :].tolist()]
    texts, token_ids, finished = (list(column) for column in zip(*rows))
    TrainingTokens.total += 0 if TrainingTokens.paused else sum(map(len, token_ids))
    return Generation(texts, token_ids, prompt_ids, finished)


def fit_context(prompt_ids, model, max_new_tokens):
    """Prompts that leave less than max_new_tokens of the model's context (max_position_embeddings) cut in the middle
    to fit, FlashRAG's rule: the first and last halves kept (the instruction and the question at the ends), warned."""
    room = (getattr(model.config, "max_position_embeddings", None) or 0) - max_new_tokens
    if room < 2 or all(len(p) <= room for p in prompt_ids):
        return prompt_ids
    warnings.warn(f"{sum(len(p) > room for p in prompt_ids)} prompt(s) cut in the middle to {room} tokens (context)")
    return [p if len(p) <= room else p[: room // 2] + p[len(p) - (room - room // 2) :] for p in prompt_ids]


def stop_criterion(tokenizer, stop, prompt_width):
    """A generate stopping criterion: True for the rows whose newly generated text holds a stop string."""
    # transformers' own stop_strings breaks on word-level vocabularies (StopStringCriteria cannot clean their tokens)
    window = max(map(len, stop)) + 4  # a stop string of n characters spans at most n tokens (+ skipped specials)

    def stopped(input_ids, scores, **kwargs):
        tails = tokenizer.batch_decode(input_ids[:, prompt_width:][:, -window:], skip_special_tokens=True)
        return torch.tensor([first_stop_end(tail, stop) is not None for tail in tails], device=input_ids.device)

    return stopped


def finish_row(ids, tokenizer, stop, eos_ids):
    """(text, ids, finished) of one generated row: cut after its first EOS or stop string, so padding is dropped."""
    eos_at = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    ids = ids if eos_at is None else ids[: eos_at + 1]
    ids, text, stopped = cut_at_stop(ids, lambda part: tokenizer.decode(part, skip_special_tokens=True), stop)
    return text, ids, stopped or eos_at is not None


def first_stop_end(text, stop):
    """The index just after the earliest-ending stop string in text, or None."""
    ends = [text.find(s) + len(s) for s in stop if s and s in text]
    return min(ends) if ends else None


def cut_at_stop(ids, decode, stop):
    """(ids, text, stopped): text cut after its first stop string (kept), ids cut after the token that completes it."""
    text = decode(ids)
    end = first_stop_end(text, stop)
    if end is None:
        return ids, text, False
    low, high = 1, len(ids)  # binary search for the shortest prefix whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if first_stop_end(decode(ids[:middle]), stop) is not None else (middle + 1, high)
    return ids[:low], text[:end], True


def make_llm(spec, **kw):
    """A frozen LLM with .chat(messages_lists, **sampling) -> list[str], chosen by a spec string (see LLM_SPECS)."""
    spec = str(spec)
    if spec.startswith("hf:") and spec[len("hf:") :]:
        return HFChatLLM(spec[len("hf:") :], **kw)
    if spec.startswith(("http://", "https://")):
        return EndpointLLM(spec, **kw)
    raise ValueError(f"unknown LLM spec {spec!r}; accepted forms: {LLM_SPECS}")


class HFChatLLM:
    """A local transformers model answering chats, batch_size conversations per generate call, on `device` (default:
    the run's, this process's GPU under accelerate launch, else the CPU)."""

    def __init__(self, name_or_path, batch_size=16, device=None, **load_kwargs):
        from accelerate import PartialState

        device = device or PartialState().device
        self.model, self.tokenizer = load_model_and_tokenizer(name_or_path, device=device, **load_kwargs)
        self.model.eval()
        self.batch_size = batch_size

    @evaluation  # a frozen LLM's replies: not the trained model's generation
    def chat(self, messages_lists, temperature=0.0, top_p=1.0, max_tokens=256, stop=(), seed=None):
        """One reply per conversation; temperature 0 means greedy."""
        replies = []
        for start in range(0, len(messages_lists), self.batch_size):
            batch = messages_lists[start : start + self.batch_size]
            sampling = dict(
                do_sample=temperature > 0, temperature=temperature or 1.0, top_p=top_p, stop=stop, seed=seed
            )
            replies += chat_generate(self.model, self.tokenizer, batch, max_new_tokens=max_tokens, **sampling).texts
        return replies


class EndpointLLM:
    """An OpenAI-compatible chat endpoint; the API key comes from the environment variable `api_key_env`."""

    def __init__(
        self, url, model=None, api_key_env="OPENAI_API_KEY", timeout=120.0, max_retries=5, backoff=1.0, workers=16
    ):
        if not model:
            raise ValueError(f"{url}: an endpoint LLM needs model=<the served model name>")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.api_key_env, self.timeout = model, api_key_env, timeout
        self.max_retries, self.backoff, self.workers = max_retries, backoff, workers

    def chat(self, messages_lists, temperature=0.0, top_p=1.0, max_tokens=256, stop=(), seed=None):
        """One reply per conversation, requested concurrently, returned in input order."""
        body = {"model": self.model, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        body |= {"stop": as_list(stop)} if stop else {}
        body |= {"seed": seed} if seed is not None else {}
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(lambda messages: self.complete({**body, "messages": messages}), messages_lists))

    def complete(self, body):
        """The reply to one chat completion request, retrying 408/429/5xx and connection errors with backoff."""
        key = os.environ.get(self.api_key_env)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers)
        for attempt in range(1, self.max_retries + 2):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return reply_text(json.load(response), self.url)
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read(300).decode(errors='replace')}"
                if e.code not in RETRY_STATUS:
                    break
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                error = f"{type(e).__name__}: {e}"
            except ValueError:
                error = "the response is not JSON"
                break
            if attempt <= self.max_retries:
                time.sleep(self.backoff * 2 ** (attempt - 1))
        message = f"{self.url}: request failed after {attempt} attempt(s): {error}"
        raise LLMRequestError(message.replace(key, "***") if key else message) from None


def reply_text(reply, url):
    """The message content of an OpenAI chat completion response."""
    try:
        return reply["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise LLMRequestError(f"{url}: not a chat completion response: {str(reply)[:200]}") from None
