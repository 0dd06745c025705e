"""common/llm.py on a tiny word-level Qwen2 built offline, and the endpoint client against a local fake server."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported (tests/conftest.py does the same)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from common import llm, runs
from common.llm import (
    Generation,
    LLMRequestError,
    ModelLoadError,
    chat_generate,
    chat_prompts,
    cut_at_stop,
    generate,
    load_model_and_tokenizer,
    make_llm,
    unknown_words,
)

VOCAB = ["<pad>", "<eos>", "<unk>", "system", "user", "assistant", ":", "<search>", "</search>"] + [
    f"w{i}" for i in range(40)
]
ID = {word: i for i, word in enumerate(VOCAB)}
PAD, EOS = ID["<pad>"], ID["<eos>"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
# The "chain" model greedily follows these transitions; every other token is followed by <eos>.
CHAIN = {":": "w1", "w1": "<search>", "<search>": "w2", "w2": "</search>", "</search>": "w3", "w3": "<eos>"}
CHAIN_REPLY = ["w1", "<search>", "w2", "</search>", "w3", "<eos>"]


def ids(text):
    """Ids of space-separated vocabulary words."""
    return [ID[word] for word in text.split()]


def user(text):
    """A one-message conversation."""
    return [{"role": "user", "content": text}]


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB with pad/eos tokens and a simple chat template."""
    backend = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.padding_side = "right"  # the loader must switch it to left
    return tokenizer


def tiny_qwen2(seed=0):
    """A randomly initialised 2-layer Qwen2 over VOCAB."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=PAD,
        eos_token_id=EOS,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def chain_qwen2():
    """A tiny Qwen2 whose next token depends only on the current one (CHAIN), so its greedy output is known."""
    model = tiny_qwen2()
    with torch.no_grad():
        for (
            layer
        ) in model.model.layers:  # layers add nothing: the residual stream carries the token's one-hot embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for word, i in ID.items():
            model.model.embed_tokens.weight[i, i] = 1.0
            model.lm_head.weight[ID[CHAIN.get(word, "<eos>")], i] = 1.0
    return model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Folders holding the random tiny model and the chain model, each with the tokenizer."""
    dirs = {}
    for name, model in [("tiny", tiny_qwen2()), ("chain", chain_qwen2())]:
        dirs[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(dirs[name])
        tiny_tokenizer().save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def tiny(model_dirs):
    """(model, tokenizer) of the random tiny model, loaded back from its folder."""
    return load_model_and_tokenizer(model_dirs["tiny"])


@pytest.fixture(scope="module")
def chain(model_dirs):
    """(model, tokenizer) of the chain model, loaded back from its folder."""
    return load_model_and_tokenizer(model_dirs["chain"])


# ---------------------------------------------------------------- loading


def test_local_folder_loads_the_saved_model_and_tokenizer(tiny):
    model, tokenizer = tiny
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == PAD and tokenizer.eos_token_id == EOS
    # transformers 5 would load a qwen2 folder's tokenizer as Qwen2Tokenizer (byte-level BPE): "w1 w2" -> other ids
    assert tokenizer("user : w1 w2 <eos>", add_special_tokens=False)["input_ids"] == ids("user : w1 w2 <eos>")
    reference = tiny_qwen2()
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert model.dtype == torch.float32


def test_dtype_is_passed_to_from_pretrained(model_dirs):
    model, _ = load_model_and_tokenizer(model_dirs["tiny"], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_unreachable_hub_id_raises_a_clear_error():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model") as caught:
        load_model_and_tokenizer("no-such-org/no-such-model")
    assert isinstance(caught.value, ValueError) and "hub" in str(caught.value)
    assert caught.value.__suppress_context__  # raised `from None`: no hub traceback chained to it


def test_missing_or_empty_local_folder_raises_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_and_tokenizer(str(tmp_path / "no_such_folder"))
    with pytest.raises(ModelLoadError, match="local folder"):
        load_model_and_tokenizer(tmp_path)
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(
        tmp_path
    )  # runs/nope/dpo in a folder holding runs/: a checkpoint that is not there, not a hub id
    with pytest.raises(ModelLoadError, match="^model folder 'runs/nope/dpo' does not exist$"):
        load_model_and_tokenizer("runs/nope/dpo")
    with pytest.raises(ModelLoadError, match="as a hub id"):  # org/name, no folder org/ here
        load_model_and_tokenizer("nope/dpo")


@pytest.mark.parametrize("as_dict", [True, False])
def test_lora_leaves_only_lora_weights_trainable(model_dirs, tiny, as_dict):
    from peft import LoraConfig

    options = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = options if as_dict else LoraConfig(task_type="CAUSAL_LM", **options)
    model, tokenizer = load_model_and_tokenizer(model_dirs["tiny"], lora=lora)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
    assert all("lora_A" in name or "lora_B" in name for name in trainable)
    # lora_B starts at zero, so the wrapped model generates exactly what the base model does
    prompts = chat_prompts(tokenizer, [user("w4 w5"), user("w6")])
    wrapped = generate(model, tokenizer, prompts, 6, do_sample=False)
    assert wrapped.token_ids == generate(*tiny, prompts, 6, do_sample=False).token_ids


def test_common_llm_knows_nothing_of_the_toy_world(model_dirs):
    """The toy sentinels belong to common.models: here "toy-lm" is a (malformed) hub id and "toy" no LLM spec."""
    with pytest.raises(ModelLoadError, match="'toy-lm' as a hub id"):
        load_model_and_tokenizer("toy-lm")
    for spec in ("toy", "toy:data/toy"):
        with pytest.raises(ValueError, match="accepted forms"):
            make_llm(spec)
    with pytest.raises(TypeError):  # no world: the toy world's argument is common.models'
        load_model_and_tokenizer(model_dirs["tiny"], world="data/toy")


def lora_trainable(model):
    return sorted(name for name, p in model.named_parameters() if p.requires_grad)


def test_a_lora_folder_reloads_its_base_and_adapters_trainable(model_dirs, tmp_path):
    model, tokenizer = load_model_and_tokenizer(model_dirs["tiny"], lora=dict(r=4, target_modules=["q_proj"]))
    with torch.no_grad():  # lora_B starts at 0: perturb the adapters so that a reload without them shows
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    bases = []

    def load_base(name, dtype=None, **kw):
        bases.append((name, dtype, kw))
        return load_model_and_tokenizer(name, dtype, **kw)

    for base_loader in (None, load_base):  # the default loader, and the one common.models passes
        again, _ = load_model_and_tokenizer(tmp_path, load_base=base_loader)
        assert type(again).__name__ == "PeftModelForCausalLM"
        assert lora_trainable(again) == lora_trainable(model) and len(lora_trainable(model)) == 2 * 2
        prompt = torch.tensor([ids("user : w4 w5 <eos> assistant :")])
        with torch.no_grad():
            assert torch.equal(again.eval()(input_ids=prompt).logits, model.eval()(input_ids=prompt).logits)
    assert bases == [(str(model_dirs["tiny"]), None, {"trust_remote_code": False})]  # the base the folder names


def test_backbone_of_is_the_transformer_body_without_the_lm_head(tiny, model_dirs):
    model, _ = tiny
    body = llm.backbone_of(model)
    assert body is model.model and not any(m is model.lm_head for m in body.modules())
    x = torch.tensor([ids("user : w1 w2")])
    with torch.no_grad():
        hidden = model(input_ids=x, output_hidden_states=True).hidden_states[-1]
        assert torch.equal(body(input_ids=x).last_hidden_state, hidden)
    wrapped, _ = load_model_and_tokenizer(model_dirs["tiny"], lora=dict(r=4, target_modules=["q_proj"]))
    body = llm.backbone_of(wrapped)  # peft: the wrapped model's body, LoRA layers included
    assert body is wrapped.get_base_model().model
    assert any("lora_A" in name for name, _ in body.named_parameters())
    assert not any(isinstance(m, torch.nn.Linear) and m.out_features == len(VOCAB) for m in body.modules())


def test_unknown_words_are_the_words_read_as_unk(tiny):
    _, tokenizer = tiny
    assert unknown_words(tokenizer, "w1 zorvak w2 qq zorvak") == ["zorvak", "qq"]  # once each, in order
    assert unknown_words(tokenizer, "user : w1 <search> w2 </search>") == []
    assert unknown_words(tokenizer, "w1 <unk> w2") == []  # the unk token typed out is not an unknown word

    class Slow:  # a tokenizer without offsets (a python tokenizer): white-space words one at a time
        is_fast, unk_token, unk_token_id = False, "<unk>", tokenizer.unk_token_id

        def __call__(self, text, **kwargs):
            return tokenizer(text, **kwargs)

    assert unknown_words(Slow(), "w1 zorvak w2") == ["zorvak"]


def test_unknown_words_is_empty_without_an_unk_token_or_for_byte_level_bpe():
    from tokenizers import decoders, trainers

    backend = Tokenizer(models.WordLevel({"<pad>": 0, "a": 1}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    no_unk = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    assert no_unk.unk_token_id is None and unknown_words(no_unk, "a zorvak") == []
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(initial_alphabet=alphabet, special_tokens=["<unk>"])
    bpe.train_from_iterator(["hello world"] * 4, trainer)
    byte_level = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")
    assert byte_level.unk_token_id is not None and unknown_words(byte_level, "zorvak xyzzy \u00e9 \u2603") == []


# ---------------------------------------------------------------- generation


def test_chat_prompts_apply_the_template(tiny):
    _, tokenizer = tiny
    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"}]
    assert chat_prompts(tokenizer, [messages, user("w4")]) == [
        "system : w1 <eos> user : w2 w3 <eos> assistant :",
        "user : w4 <eos> assistant :",
    ]


def test_greedy_batched_equals_one_by_one(tiny, monkeypatch):
    model, tokenizer = tiny
    conversations = [user("w1"), user("w2 w3 w4 w5 w6 w7"), user("w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20")]
    calls, positions = [], []
    monkeypatch.setattr(
        model, "generate", lambda *a, _generate=model.generate, **kw: calls.append(1) or _generate(*a, **kw)
    )
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: positions.append(kw["position_ids"]), with_kwargs=True
    )
    try:
        batched = chat_generate(model, tokenizer, conversations, max_new_tokens=10, do_sample=False)
    finally:
        hook.remove()
    assert len(calls) == 1  # one model.generate call for the whole batch
    lengths = [len(p) for p in batched.prompt_ids]
    for row, length in enumerate(lengths):  # positions count from the first real token, not from the padding
        assert positions[0][row, -length:].tolist() == list(range(length))
        assert positions[1][row].tolist() == [length]
    single = [chat_generate(model, tokenizer, [c], max_new_tokens=10, do_sample=False) for c in conversations]
    assert batched.token_ids == [g.token_ids[0] for g in single]  # left padding does not shift positions
    assert batched.texts == [g.texts[0] for g in single]
    assert batched.prompt_ids == [ids(p) for p in chat_prompts(tokenizer, conversations)]
    assert len(set(map(tuple, batched.token_ids))) == 3  # different prompts, different continuations
    from_ids = generate(model, tokenizer, batched.prompt_ids, 10, do_sample=False)  # id lists work like strings
    assert from_ids.token_ids == batched.token_ids


def test_generation_config_of_the_checkpoint_does_not_change_sampling(tiny):
    model, tokenizer = tiny
    prompts = chat_prompts(tokenizer, [user("w2 w3"), user("w9")])
    plain = generate(model, tokenizer, prompts, 16, do_sample=False).token_ids
    assert any(len(set(row)) < len(row) for row in plain)  # repeats, so a repetition penalty would change them
    model.generation_config.repetition_penalty = 50.0
    try:
        assert generate(model, tokenizer, prompts, 16, do_sample=False).token_ids == plain
    finally:
        model.generation_config.repetition_penalty = 1.0


def test_eos_is_kept_and_padding_dropped(chain):
    model, tokenizer = chain
    # row 0 follows the whole chain; row 1 ends at once (w7 -> <eos>) and is padded by generate while row 0 goes on
    result = generate(model, tokenizer, [ids("user : w5 <eos> assistant :"), ids("w7")], 10, do_sample=False)
    assert result.token_ids == [ids(" ".join(CHAIN_REPLY)), [EOS]]
    assert result.texts == ["w1 <search> w2 </search> w3", ""]
    assert result.finished == [True, True]
    for text, row in zip(result.texts, result.token_ids):
        assert PAD not in row and tokenizer.decode(row, skip_special_tokens=True) == text


def test_beam_search_is_deterministic_and_finds_the_chain(chain):
    model, tokenizer = chain
    prompts = [ids("user : w5 <eos> assistant :"), ids("w7")]
    beams = generate(model, tokenizer, prompts, 10, do_sample=True, num_beams=3, seed=1)  # beams never sample
    assert beams.token_ids == [ids(" ".join(CHAIN_REPLY)), [EOS]]
    assert generate(model, tokenizer, prompts, 10, num_beams=3, seed=2).token_ids == beams.token_ids


def test_max_new_tokens_leaves_a_row_unfinished(chain):
    result = chat_generate(*chain, [user("w5")], max_new_tokens=2, do_sample=False)
    assert result.token_ids == [ids("w1 <search>")] and result.texts == ["w1 <search>"] and result.finished == [False]


@pytest.mark.parametrize("stop", ["</search>", ["w9", "w2 </search>"], ("</search>", "w3")])
def test_stop_string_ends_generation_and_is_kept(chain, stop):
    model, tokenizer = chain
    forward_calls = []
    hook = model.register_forward_hook(lambda *args: forward_calls.append(1))
    try:  # the prompt's own "</search>" must not count: only generated text is searched
        result = chat_generate(
            model, tokenizer, [user("w2 </search>")] * 2, max_new_tokens=20, stop=stop, do_sample=False
        )
    finally:
        hook.remove()
    assert result.texts == ["w1 <search> w2 </search>"] * 2
    assert result.token_ids == [ids("w1 <search> w2 </search>")] * 2
    assert result.finished == [True, True]
    assert len(forward_calls) == 4  # generation stopped at the stop string instead of running to <eos>
    assert all(tokenizer.decode(row) == text for row, text in zip(result.token_ids, result.texts))


def test_cut_at_stop_on_sub_word_tokens():
    pieces = {1: "<se", 2: "arch>", 3: " who", 4: "</sea", 5: "rch>tail", 6: "x"}
    decode = lambda part: "".join(pieces[i] for i in part)
    assert cut_at_stop([1, 2, 3, 4, 5, 6], decode, ["</search>"]) == ([1, 2, 3, 4, 5], "<search> who</search>", True)
    assert cut_at_stop([1, 2, 3, 4, 5, 6], decode, ["</search>", "arch"]) == ([1, 2], "<search", True)  # earliest end
    assert cut_at_stop([1, 2, 3, 4, 5, 6], decode, ["who</search>"]) == (
        [1, 2, 3, 4, 5],
        "<search> who</search>",
        True,
    )
    assert cut_at_stop([1, 2, 3, 6], decode, ["</search>"]) == ([1, 2, 3, 6], "<search> whox", False)
    assert cut_at_stop([1, 2], decode, []) == ([1, 2], "<search>", False)


def test_same_seed_same_samples_other_seed_other_samples(tiny):
    model, tokenizer = tiny
    prompts = chat_prompts(tokenizer, [user("w1 w2"), user("w3")])
    sample = lambda seed: generate(model, tokenizer, prompts, 12, temperature=1.0, seed=seed).token_ids
    first, again, other = sample(1), sample(1), sample(2)
    assert first == again
    assert first != other
    assert first != generate(model, tokenizer, prompts, 12, do_sample=False).token_ids


def test_empty_batch():
    assert generate(None, None, [], 5) == Generation([], [], [], [])


# ---------------------------------------------------------------- frozen LLMs


def test_hf_llm_chats_in_batches(model_dirs):
    reader = make_llm(f"hf:{model_dirs['chain']}", batch_size=2)
    replies = reader.chat([user("w5"), user("w6 w7"), user("w8")], stop="</search>")
    assert replies == ["w1 <search> w2 </search>"] * 3
    assert reader.chat([user("w5")], max_tokens=1) == ["w1"]


@pytest.mark.parametrize("spec", ["gpt-4o", "hf:", "ftp://host/v1", ""])
def test_unknown_spec_lists_the_accepted_forms(spec):
    with pytest.raises(ValueError, match="accepted forms") as caught:
        make_llm(spec)
    assert all(form in str(caught.value) for form in ['"hf:', '"http(s)://'])
    assert "toy" not in str(caught.value)  # the toy forms are common.models' (tests/test_models.py)


class FakeOpenAI:
    """An OpenAI-compatible /v1/chat/completions server on 127.0.0.1 in a thread; replies "re: <last message>".

    `failures` are HTTP status codes answered, in order, to the first requests; their body echoes the Authorization
    header (as a careless server might), so tests can check that the key never reaches an error message.
    A message starting with "slow" is answered after 0.3 s.
    """

    def __init__(self, failures=()):
        self.failures, self.requests, self.completed, self.lock = list(failures), [], [], threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    status = server.failures.pop(0) if server.failures else 200
                if status != 200:
                    return self.reply(status, {"error": "boom", "auth": self.headers.get("Authorization")})
                content = body["messages"][-1]["content"]
                time.sleep(0.3 if content.startswith("slow") else 0)
                with server.lock:
                    server.completed.append(content)
                self.reply(
                    200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"re: {content}"}}]}
                )

            def reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


SECRET = "sk-test-0123456789SECRET"


def test_endpoint_request_body_and_authorization(monkeypatch):
    monkeypatch.setenv("TEST_LLM_KEY", SECRET)
    with FakeOpenAI() as server:
        endpoint = make_llm(server.url + "/", model="served-model", api_key_env="TEST_LLM_KEY")
        replies = endpoint.chat([user("hello")], temperature=0.7, top_p=0.9, max_tokens=7, stop="</search>", seed=3)
    assert replies == ["re: hello"]
    [request] = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == f"Bearer {SECRET}"
    assert request["headers"]["Content-Type"] == "application/json"
    assert request["body"] == {
        "model": "served-model", "messages": user("hello"), "temperature": 0.7, "top_p": 0.9, "max_tokens": 7,
        "stop": ["</search>"], "seed": 3,
    }  # fmt: skip


def test_endpoint_without_key_sends_no_authorization(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeOpenAI() as server:
        assert make_llm(server.url, model="m").chat([user("x")]) == ["re: x"]
    assert "Authorization" not in server.requests[0]["headers"]
    defaults = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 256}
    assert server.requests[0]["body"] == {"model": "m", "messages": user("x"), **defaults}


def test_endpoint_requests_run_concurrently_and_replies_keep_input_order():
    with FakeOpenAI() as server:
        replies = make_llm(server.url, model="m").chat(
            [user("slow 0"), user("slow 1"), user("fast 2"), user("fast 3")]
        )
    assert replies == ["re: slow 0", "re: slow 1", "re: fast 2", "re: fast 3"]
    assert set(server.completed[:2]) == {"fast 2", "fast 3"}  # sent together, so the fast ones were answered first


def test_endpoint_retries_after_500_and_429():
    with FakeOpenAI(failures=[500, 429]) as server:
        assert make_llm(server.url, model="m", backoff=0.01).chat([user("again")]) == ["re: again"]
    assert len(server.requests) == 3


def test_endpoint_gives_up_with_a_clear_error_that_hides_the_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with FakeOpenAI(failures=[503] * 10) as server:
        with pytest.raises(LLMRequestError) as caught:
            make_llm(server.url, model="m", max_retries=2, backoff=0.01).chat([user("x")])
    assert len(server.requests) == 3
    message = str(caught.value)
    assert "HTTP 503" in message and "3 attempt" in message and server.url in message
    assert SECRET not in message and "***" in message  # the server echoed the key; the message masks it
    assert caught.value.__suppress_context__


def test_endpoint_does_not_retry_a_client_error():
    with FakeOpenAI(failures=[400]) as server:
        with pytest.raises(LLMRequestError, match="HTTP 400"):
            make_llm(server.url, model="m", backoff=0.01).chat([user("x")])
    assert len(server.requests) == 1


def test_endpoint_connection_refused_is_retried_then_reported():
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(LLMRequestError, match="2 attempt"):
        make_llm(f"http://127.0.0.1:{port}/v1", model="m", max_retries=1, backoff=0.01).chat([user("x")])


def test_endpoint_needs_a_model_name():
    with pytest.raises(ValueError, match="model="):
        make_llm("http://127.0.0.1:1/v1")


def test_right_pad_pads_on_the_right():
    assert llm.right_pad([[5, 6, 7], [8]], 0).tolist() == [[5, 6, 7], [8, 0, 0]]
    assert llm.right_pad([[1], [2, 3]], -100).tolist() == [[1, -100], [2, 3]]


def test_a_prompt_longer_than_the_context_is_cut_in_the_middle_with_a_warning():
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm("toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32,max_positions=32")
    long, short = list(range(10, 60)), list(range(10, 20))  # 50 and 10 token ids; room 32 - 4 = 28
    with pytest.warns(UserWarning, match=r"^1 prompt\(s\) cut in the middle to 28 tokens \(context\)$"):
        out = generate(model, tokenizer, [long, short], max_new_tokens=4, do_sample=False)
    assert out.prompt_ids == [long[:14] + long[-14:], short]  # the first and last 14 kept; the short one untouched
    assert all(len(ids) <= 4 for ids in out.token_ids)
    with pytest.warns(UserWarning):
        assert llm.fit_context([long], model, 3) == [long[:14] + long[-15:]]  # odd room: the tail takes the extra one
    assert llm.fit_context([long], model, 31) == [long]  # no room to cut to (under 2 tokens): left as it is


def test_training_tokens_count_what_generate_writes_outside_evaluations(tiny):
    model, tokenizer = tiny
    start = runs.TrainingTokens.total
    written = generate(model, tokenizer, ["a b", "c"], 3, do_sample=False).token_ids
    assert sum(map(len, written)) > 0 and runs.TrainingTokens.total == start + sum(map(len, written))
    evaluated = runs.evaluation(lambda: generate(model, tokenizer, ["a b"], 3, do_sample=False))
    assert evaluated().token_ids  # it generated, and nothing was counted
    assert runs.TrainingTokens.total == start + sum(map(len, written)) and not runs.TrainingTokens.paused
    with pytest.raises(ZeroDivisionError):  # an evaluation that fails leaves the counter counting
        runs.evaluation(lambda: 1 / 0)()
    assert not runs.TrainingTokens.paused
