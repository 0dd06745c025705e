"""common/models.py: the one place that maps a model name or an LLM spec to a backend. Hub ids, folders and
OpenAI-compatible endpoints go to common.llm; "toy-lm[:options]" (with the world it takes its vocabulary from) and
"toy[:<world dir>]" to the toy world, which common.llm never sees."""

import sys
import types

import pytest
import torch

from common import llm, models, toy
from common.llm import ModelLoadError

COMMITTED = toy.DEFAULT_WORLD
TINY_LM = "toy-lm:layers=1,hidden=16,heads=2,kv_heads=2,intermediate=32"
LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def fake_toy_lm(monkeypatch):
    """common.toy.lm replaced by a module whose load_toy_lm records its calls and returns a stand-in model."""
    calls, fake, model = [], types.ModuleType("common.toy.lm"), types.SimpleNamespace()
    fake.load_toy_lm = lambda name, **kw: calls.append((name, kw)) or (model, "tokenizer")
    monkeypatch.setitem(sys.modules, "common.toy.lm", fake)
    return calls, model


@pytest.mark.parametrize(
    "name, toy_lm",
    [
        ("toy-lm", True),
        ("toy-lm:layers=2", True),
        ("toy-lm-finetuned", False),
        ("toy", False),
        ("Qwen/Qwen2-0.5B", False),
    ],
)
def test_is_toy_lm_only_for_the_sentinel(name, toy_lm):
    assert models.is_toy_lm(name) is toy_lm


def test_toy_lm_names_are_built_for_the_world_given(fake_toy_lm):
    calls, model = fake_toy_lm
    assert models.load_model_and_tokenizer("toy-lm:layers=2", dtype=torch.float32, world="w1") == (model, "tokenizer")
    assert model.name_or_path == "toy-lm:layers=2"  # what a LoRA checkpoint records as its base
    assert calls == [("toy-lm:layers=2", dict(dtype=torch.float32, device=None, world="w1"))]
    with pytest.raises(ModelLoadError, match=r"toy world: pass --world DIR"):  # never silently the committed world
        models.load_model_and_tokenizer("toy-lm")
    with pytest.raises(ModelLoadError, match="hub id"):  # a name that only starts like the sentinel is not it
        models.load_model_and_tokenizer("toy-lm-finetuned", world="w1")
    assert len(calls) == 1


def test_a_toy_lm_needs_a_toy_world_folder(tmp_path):
    with pytest.raises(ModelLoadError, match=r"cannot build 'toy-lm'.*world\.json"):
        models.load_model_and_tokenizer("toy-lm", world=tmp_path)


def test_other_names_go_to_common_llm_with_a_base_loader_that_knows_the_toy_world(monkeypatch, fake_toy_lm):
    calls, model = fake_toy_lm
    seen = []
    monkeypatch.setattr(llm, "load_model_and_tokenizer", lambda *a, **kw: seen.append((a, kw)) or ("m", "t"))
    assert models.load_model_and_tokenizer("org/name", "bf16", "cpu", {"r": 2}, True, world="w2") == ("m", "t")
    [(positional, keywords)] = seen
    assert positional == ("org/name", "bf16", "cpu", {"r": 2}, True) and list(keywords) == ["load_base"]
    # the base of a LoRA folder is loaded by common.models, in the same world: a toy-lm base works
    assert keywords["load_base"]("toy-lm", torch.float32, trust_remote_code=False) == (model, "tokenizer")
    assert calls == [("toy-lm", dict(dtype=torch.float32, device=None, world="w2"))]


def test_other_names_ignore_the_world(tmp_path):
    from common.toy.lm import load_toy_lm

    saved, tokenizer = load_toy_lm(TINY_LM, world=COMMITTED)
    saved.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, loaded = models.load_model_and_tokenizer(tmp_path, world="no/such/world")
    assert loaded.get_vocab() == tokenizer.get_vocab() and loaded.padding_side == "left"
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)


def test_a_lora_folder_over_a_toy_lm_base_reloads_trainable(tmp_path):
    model, tokenizer = models.load_model_and_tokenizer(TINY_LM, lora=LORA, world=COMMITTED)
    assert type(model).__name__ == "PeftModelForCausalLM" and tokenizer.padding_side == "left"
    trainable = lambda m: sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert trainable(model) and all("lora_" in n for n in trainable(model))
    with torch.no_grad():  # lora_B starts at 0: perturb the adapters so that a reload without them shows
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and not (tmp_path / "model.safetensors").exists()
    again, tokenizer_again = models.load_model_and_tokenizer(tmp_path, world=COMMITTED)
    assert type(again).__name__ == "PeftModelForCausalLM" and trainable(again) == trainable(model)
    assert tokenizer_again.get_vocab() == tokenizer.get_vocab()
    ids = torch.tensor([tokenizer("question : who is the director of zorvak ?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, again.eval()(input_ids=ids).logits)
    with pytest.raises(ModelLoadError, match="toy world"):  # its toy-lm base needs the world, here too
        models.load_model_and_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="hub id"):  # common.llm alone does not know the toy-lm base
        llm.load_model_and_tokenizer(tmp_path)


def test_toy_specs_build_the_toy_reader(monkeypatch, tmp_path):
    fake = types.ModuleType("common.toy")
    fake.ToyReader = lambda world_dir, **kw: ("reader", str(world_dir), kw)
    monkeypatch.setitem(sys.modules, "common.toy", fake)
    assert models.make_llm("toy") == ("reader", str(COMMITTED), {})
    assert models.make_llm(f"toy:{tmp_path}") == ("reader", str(tmp_path), {})
    assert models.make_llm("toy", batch_size=3) == ("reader", str(COMMITTED), {"batch_size": 3})


def test_a_toy_spec_with_a_folder_builds_the_reader_of_that_world(tmp_path):
    world_dir = toy.write_world(tmp_path / "w", seed=3, size=0.3)
    reader = models.make_llm(f"toy:{world_dir}")
    assert isinstance(reader, toy.ToyReader)
    assert reader.world["entities"] == toy.load_world(str(world_dir))["entities"]
    assert reader.world["entities"] != toy.load_world(str(COMMITTED))["entities"]
    assert models.make_llm("toy").world["entities"] == toy.load_world(str(COMMITTED))["entities"]


def test_hf_and_endpoint_specs_go_to_common_llm(monkeypatch):
    monkeypatch.setattr(llm, "HFChatLLM", lambda name, **kw: ("hf", name, kw))
    assert models.make_llm("hf:some/folder", batch_size=2) == ("hf", "some/folder", {"batch_size": 2})
    endpoint = models.make_llm("http://127.0.0.1:1/v1", model="served")
    assert isinstance(endpoint, llm.EndpointLLM) and endpoint.model == "served"
    with pytest.raises(ValueError, match="model="):  # common.llm's own errors pass through unchanged
        models.make_llm("http://127.0.0.1:1/v1")


@pytest.mark.parametrize("spec", ["gpt-4o", "hf:", "ftp://host/v1", "", "toys", "toy-lm"])
def test_unknown_spec_lists_the_accepted_forms_toy_ones_included(spec):
    with pytest.raises(ValueError, match="accepted forms") as caught:
        models.make_llm(spec)
    assert all(form in str(caught.value) for form in ['"hf:', '"http(s)://', '"toy"', '"toy:'])
    assert caught.value.__suppress_context__  # one message, not common.llm's chained under it
