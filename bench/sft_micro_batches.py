"""Seconds per SFT step of c3po.py's own `sft()` on the toy warm-up set: one padded batch against length-sorted
micro-batches, each padded only to its own longest sequence (the same gradient, less padding).

    python bench/sft_micro_batches.py                       # toy preset, seed 0, 100 steps per setting
    python bench/sft_micro_batches.py --micro 256 8 4 --steps 50

Every setting starts from the same raw `toy-lm` and takes the same batches (the SFT order comes from --seed), so the
figures differ only in how the batch is cut; the loss printed last shows that they train the same.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import c3po  # noqa: E402
from common import runs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, nargs="+", default=[256, 8], help="micro-batch sizes to compare")
    parser.add_argument("--steps", type=int, default=100, help="SFT steps per setting")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    (args,) = runs.flag_parser(c3po.Args).parse_args_into_dataclasses(args=["--train", "--seed", str(cli.seed)])
    c3po.apply_preset(args)
    rows = c3po.sample_rows(c3po.load_split(args.data_dir, "train", args.question_types), args.n_train, args.seed)
    env = c3po.environment(args)
    examples, _ = c3po.build_warmup(rows, env.llm, env, args)
    world = c3po.toy.renaming_world(args)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(examples)} warm-up examples, "
        f"batches of {args.sft_batch_size}, {cli.steps} steps per setting"
    )
    for micro in cli.micro:
        torch.manual_seed(args.seed)
        model, tokenizer = c3po.load_proxy(args, torch.device("cpu"))
        args.sft_steps, args.micro_batch_size = cli.steps, micro
        start = time.time()
        model, _ = c3po.sft(Accelerator(cpu=True), model, tokenizer, examples, args, world, tempfile.mkdtemp())
        print(f"micro_batch_size {micro:4d}: {(time.time() - start) / cli.steps:.3f} s per SFT step")


if __name__ == "__main__":
    main()
