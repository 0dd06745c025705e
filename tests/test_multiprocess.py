"""Every method's --train under `accelerate launch` with two real CPU processes (gloo): one run folder, one RESULT line
from the main process, the result contract, each stage stepped. smartrag's own test (tests/test_smartrag.py) also
resumes such a run; sparcrag's DPO steps on pairs gathered from both processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import check_contract, free_port

ROOT = Path(__file__).resolve().parents[1]
TINY_LM = "toy-lm:layers=1,hidden=32,heads=2,kv_heads=2,intermediate=64"
PPO = ["--n_train", "32", "--n_eval", "8", "--sft_steps", "8", "--ppo_iterations", "2", "--rollout_batch", "4",
       "--sft_batch_size", "16", "--ppo_batch_size", "64"]  # fmt: skip
FLAGS = {  # method: (flags, the train_steps the run must report)
    "c3po": (PPO, {"sft": 8, "ppo": 2}),
    # the paper preset (top-10, 20 triples, L = 4, the paper's templates; the toy reader and oracle teacher): a warm-up
    # split over both processes, SFT batches of 3 (2 + 1), a rollout of 1 question (process 1 holds no tree)
    "sparkle": (["--preset", "paper", "--llm", "toy", "--encoder", "tfidf", "--teacher_model", "oracle", "--n_train",
                 "6", "--n_eval", "3", "--sft_batch_size", "3", "--sft_steps", "2", "--ppo_iterations", "2",
                 "--rollout_batch", "1", "--ppo_batch_size", "8", "--max_new_tokens", "16"], {"sft": 2, "ppo": 2}),
    "tearag": (["--sft_steps", "4", "--n_dpo", "6", "--n_rollouts", "2", "--n_eval", "12", "--rounds", "1", "--eta",
                "1", "--dpo_epochs", "1", "--rollout_batch", "6", "--max_new_tokens", "32"],
               {"curriculum": 3, "sft": 4, "dpo": 0}),  # the toy curriculum: 2/3 of --sft_steps, rounded
    "sparcrag": (["--n_train", "12", "--n_eval", "6", "--sft_steps", "6", "--dpo_epochs", "1",
                  "--untuned_depth", "2", "--depth", "2", "--max_new_tokens", "96", "--seed", "0"],
                 {"sft": 6, "dpo": 1}),  # two adapters: the evaluator's 1 step (6 warm-up steps: no rewrite pair)
    # the paper preset (no warm-up, one adapter, micro-batch 1), the toy reader as the frozen roles; DPO batches of 1
    # pair: every step leaves the second process a stand-in (weight 0) that must still run DDP's backward
    "sparcrag:paper": (["--preset", "paper", "--llm", "toy", "--encoder", "tfidf", "--synthesize_missing", "--n_train",
                        "4", "--n_eval", "4", "--max_new_tokens", "16", "--depth", "2",
                        "--untuned_depth", "2", "--dpo_epochs", "1", "--dpo_batch_size", "1", "--seed", "0"],
                       {"sft": 0, "dpo": None}),
}  # fmt: skip


@pytest.mark.parametrize("method", list(FLAGS))
def test_train_runs_in_two_processes_with_one_result(method, tmp_path):
    (flags, steps), method = FLAGS[method], method.split(":")[0]  # "method:case": another case of the method
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "no"]
    if method == "c3po":  # the multi-GPU config file users launch with, on CPU (gloo)
        launch += ["--config_file", str(ROOT / "configs" / "accelerate" / "multi_gpu.yaml")]
    else:
        launch += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    launch += ["--main_process_port", free_port()]
    command = [str(ROOT / f"{method}.py"), "--train", "--run_name", "ddp", "--data_dir", str(ROOT / "data" / "toy")]
    command += ["--model", TINY_LM, *flags]
    done = subprocess.run(launch + command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["ddp"] and done.stdout.count("RESULT ") == 1
    results = check_contract(tmp_path / "runs" / "ddp", done.stdout)
    if steps.get("dpo", 0) is None:  # one step per pair (batches of 1, one epoch), at least one
        steps = steps | {"dpo": sum(n for k, n in results["pairs"].items() if not k.startswith("weight_")) or None}
    assert results["method"] == method and results["train_steps"] == steps
    state = json.loads(
        (tmp_path / "runs" / "ddp" / ("ppo" if "ppo" in steps else "dpo") / "run_state.json").read_text()
    )
    if method != "sparcrag":  # its DPO checkpoint is written once, at the end of the stage: no random states
        assert len(state["rng"]) == 2  # each process's own, for --resume
    if "ppo" in steps:  # sparkle: rank-seeded question sampling; c3po: one global batch, the same draws everywhere
        assert (state["rng"][0]["own"] == state["rng"][1]["own"]) == (method == "c3po")


def test_c3po_paper_preset_trains_in_two_processes_with_short_batches(tmp_path):
    """c3po --preset paper (App. B.1 prompts, top-10, Tab. 6-7 batch sizes, micro-batches of 4) with a tiny random
    Qwen2 saved as from_pretrained reads it, the toy reader as the LLM and the oracle teacher (a random model solves
    nothing), under two processes: one tree per PPO update (process 1 rolls out a stand-in of weight 0), a warm-up
    built once over both, and the result contract."""
    from common.toy.lm import load_toy_lm

    model, tokenizer = load_toy_lm(TINY_LM)
    model.save_pretrained(tmp_path / "qwen2")
    tokenizer.save_pretrained(tmp_path / "qwen2")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command = [str(ROOT / "c3po.py"), "--train", "--preset", "paper", "--run_name", "paper", "--model"]
    command += [str(tmp_path / "qwen2"), "--data_dir", str(ROOT / "data" / "toy"), "--encoder", "tfidf", "--llm"]
    command += ["toy", "--judge", "cover_em", "--teacher", "oracle", "--n_train", "5", "--n_eval", "3", "--sft_epochs"]
    command += ["1", "--ppo_iterations", "1", "--rollout_batch", "1", "--max_new_tokens", "16"]
    done = subprocess.run([*launch, "--main_process_port", free_port(), *command], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = check_contract(tmp_path / "runs" / "paper", done.stdout)
    assert results["preset"] == "paper" and results["train_steps"] == {"sft": 1, "ppo": 1}
    assert results["args"]["micro_batch_size"] == 4 and results["args"]["top_k"] == 10
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "paper" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/samples"] > 0 for m in metrics if "iteration" in m] == [True]


def test_tearag_paper_preset_trains_in_two_processes_on_a_short_last_batch(tmp_path):
    """tearag.py --preset paper (the instruction prompt, LoRA r 8, R = 8, epochs 2,2,1 cut to 1 round, micro-batch 2)
    under two processes: 3 IP-DPO questions (shares 2 and 1), their pairs gathered on both, 2 pairs a step (the last
    step 1 pair: process 1 runs a stand-in of weight 0). A random model writes no correct path, so each question's
    first two paths make its pair (build_pairs is tested apart)."""
    script = tmp_path / "tearag_paired.py"
    script.write_text(
        "import tearag\nfrom common import runs\n\n"
        "tearag.build_pairs = lambda rewards, single_hop: [(0, 1, 'format')]\nruns.run_main(tearag.main)\n"
    )
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "no"]
    launch += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", free_port()]
    flags = ["--train", "--preset", "paper", "--run_name", "paper", "--data_dir", str(ROOT / "data" / "toy"),
             "--model", TINY_LM, "--encoder", "tfidf", "--reranker", "lexical", "--sft_steps", "2", "--sft_batch_size",
             "3", "--n_dpo", "3", "--n_eval", "3", "--rounds", "1", "--eta", "1", "--dpo_epochs", "2",
             "--dpo_batch_size", "2", "--rollout_batch", "2", "--max_new_tokens", "16"]  # fmt: skip
    done = subprocess.run(launch + [str(script), *flags], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = check_contract(tmp_path / "runs" / "paper", done.stdout)
    assert results["preset"] == "paper" and results["train_steps"] == {"sft": 2, "dpo": 4}  # 2 epochs of 2 steps
    assert results["rounds"][0]["pairs"] == 3 and results["args"]["micro_batch_size"] == 2
    assert (tmp_path / "runs" / "paper" / "dpo" / "adapter_config.json").is_file()  # LoRA [§5.1.3]


def test_tearag_extraction_splits_the_chunks_over_two_processes(tmp_path):
    """tearag.py --extract_triples (§4.1) under two processes on the endpoint of tests/real_data.py, resuming the part
    an earlier launch of more processes left (chunk 0 done): every other chunk asked once, one graph written, each
    invented fact once, with the chunk that states it."""
    import real_data

    real_data.write_folder(tmp_path)
    facts, out = real_data.triples(real_data.passages()), tmp_path / "graph.jsonl"
    seeded = [[r["head"], r["relation"], r["tail"]] for r in facts if r["doc_id"] == "0"]
    (tmp_path / "graph.jsonl.part7").write_text(json.dumps({"doc_id": "0", "triplets": seeded}) + "\n")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "no"]
    launch += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", free_port()]
    with real_data.chat_stub() as stub:
        flags = ["--extract_triples", stub.url, "--model", "stub", "--data_dir", str(tmp_path), "--triples", str(out)]
        done = subprocess.run(launch + [str(ROOT / "tearag.py"), *flags], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "triplets (process 1)" in done.stderr, done.stderr[-3000:]
    assert stub.calls == {"Extract the knowledge triplets": len(real_data.passages()) - 1}
    key = lambda row: tuple(row.values())
    assert sorted(real_data.data.read_jsonl(out), key=key) == sorted(facts, key=key)
    assert done.stdout.count("triplets of") == 1 and sorted(p.name for p in tmp_path.glob("graph*")) == ["graph.jsonl"]


def test_smartrag_paper_preset_trains_in_two_processes_on_short_batches(tmp_path):
    """smartrag's --preset paper (a tiny random Llama, its LM head untied as Llama-2's, LoRA; the toy reader as the
    probed base model, the oracle rewriter) in two processes on counts that leave short batches: SFT batches of one
    (process 1 steps on the stand-in), a rollout batch of three questions (two and one), PPO minibatches of two. The
    rollout budget counts both processes' tokens: 9 tokens are one round (three actions of up to 8 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.toy.lm import load_toy_lm

    _, tokenizer = load_toy_lm(TINY_LM)
    torch.manual_seed(0)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, **ids)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "no"]
    launch += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", free_port()]
    command = [str(ROOT / "smartrag.py"), "--train", "--preset", "paper", "--run_name", "ddp", "--data_dir",
               str(ROOT / "data" / "toy"), "--encoder", "tfidf", "--model", str(tmp_path / "llama"), "--rewriter",
               "oracle", "--base_llm", "toy", "--n_train", "6", "--n_eval", "3", "--sft_batch_size", "1",
               "--sft_steps", "2", "--micro_batch_size", "1", "--ppo_iterations", "1", "--rollout_batch", "3",
               "--rollout_tokens", "9", "--max_new_tokens", "8", "--ppo_batch_size", "2"]  # fmt: skip
    done = subprocess.run(launch + command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = check_contract(tmp_path / "runs" / "ddp", done.stdout)
    assert results["preset"] == "paper" and results["train_steps"] == {"sft": 2, "ppo": 1}
    assert done.stdout.count("RESULT ") == 1 and (tmp_path / "runs" / "ddp" / "ppo" / "adapter_config.json").is_file()
    (update,) = [m for m in map(json.loads, (tmp_path / "runs" / "ddp" / "metrics.jsonl").open()) if "iteration" in m]
    assert update["rollout/episodes"] == 3 and update["rollout/tokens"] >= 9  # one round of both processes


@pytest.mark.parametrize(
    "name, kind, processes, stage",
    [("multi_gpu", "MULTI_GPU", 8, None), ("multi_node", "MULTI_GPU", 16, None),
     ("deepspeed_zero2", "DEEPSPEED", 8, 2), ("deepspeed_zero3", "DEEPSPEED", 8, 3)],
)  # fmt: skip
def test_accelerate_config_files_parse_as_documented(name, kind, processes, stage):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "configs" / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type == kind and config.num_processes == processes and config.mixed_precision == "bf16"
    assert (config.deepspeed_config or {}).get("zero_stage") == stage
    assert config.num_machines == (2 if name == "multi_node" else 1)


def test_the_multi_node_config_trains_across_two_machines_on_one_host(tmp_path):
    """configs/accelerate/multi_node.yaml with its machines played by two launches on this host (one CPU process
    each, gloo over 127.0.0.1): one run, whose RESULT the main machine prints."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launch += [str(ROOT / "configs" / "accelerate" / "multi_node.yaml"), "--num_processes", "2", "--mixed_precision"]
    launch += ["no", "--main_process_ip", "127.0.0.1", "--main_process_port", free_port()]
    command = [str(ROOT / "c3po.py"), "--train", "--run_name", "nodes", "--data_dir", str(ROOT / "data" / "toy")]
    command += ["--model", TINY_LM, *PPO]
    second = subprocess.Popen([*launch, "--machine_rank", "1", *command], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    first = subprocess.run([*launch, "--machine_rank", "0", *command], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=900)  # fmt: skip
    assert first.returncode == 0 and second.wait(timeout=120) == 0, first.stderr[-3000:]
    assert "RESULT " not in second.stdout.read()  # the other machine trains, the main one reports
    results = check_contract(tmp_path / "runs" / "nodes", first.stdout)
    assert results["train_steps"] == {"sft": 8, "ppo": 2}
