"""The W x D grid of SPARC-RAG's scaling analysis [§5.1, Fig. 3, Tab. 7] beside the naive baselines [App. A.5].

    python bench/sparcrag_grid.py --model runs/sparcrag/sft                    # the untuned system of a toy run
    python bench/sparcrag_grid.py --model runs/sparcrag/sft --grid_widths 1,2,4 --grid_depths 1,2,3,4,6

Any sparcrag.py flag applies (--data_dir, --n_eval, --top_k ...). Every cell runs at fixed depth (the untuned
setting, §4.5): one run of the deepest depth per width, whose round-t snapshot is the depth-t run (a fixed-depth run
is the prefix of a deeper one). The naive baselines run at several widths / attempts so their costs can be read
beside the grid's. Prints a markdown table and writes grid.json next to the model (or to --output_dir).
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compare import naive, with_naive_roles  # the naive baselines [App. A.5], beside the other baselines

import sparcrag
from common import runs
from common.data import load_split


@dataclass
class Grid:
    grid_widths: str = field(default="1,2,4", metadata={"help": "widths W [§5.1: 1, 2, 4]"})
    grid_depths: str = field(default="1,2,3,4,6", metadata={"help": "depths D [Tab. 7: 2, 4, 6, 8]"})
    naive: str = field(
        default="vanilla:1,parallel:2,parallel:4,parallel:8,sequential:3",
        metadata={"help": "naive baselines as system:n"},
    )


def table(rows, types):
    """The grid as markdown: scores, recall, rounds and cost per question, F1 by question type."""
    head = ["system", "F1", "EM", "recall", "rounds", "tokens/q", "generated/q", "calls/q"] + [
        f"F1 {t}" for t in types
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [
            r["system"],
            f"{r['f1']:.3f}",
            f"{r['em']:.3f}",
            f"{r['recall'] or 0:.3f}",
            f"{r['rounds']:.2f}",
            f"{r['tokens']:.0f}",
            f"{r['generated_tokens']:.0f}",
            f"{r['llm_calls']:.1f}",
        ]
        lines.append("| " + " | ".join(cells + [f"{r['groups'][t]['f1']:.3f}" for t in types]) + " |")
    return "\n".join(lines)


def main(argv=None):
    args, grid = runs.flag_parser((sparcrag.Args, Grid)).parse_args_into_dataclasses(args=argv)
    if args.data_dir is None and args.model and (state := runs.load_state(args.model)):
        args.data_dir = state.get("data_dir")
    args.eval = True
    sparcrag.apply_preset(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    accelerator = runs.make_accelerator()
    rows = load_split(args.data_dir, "test")[: args.n_eval]
    policy, tokenizer = sparcrag.load_policy(args, accelerator.device)
    retrievers, llm = sparcrag.frozen_parts(args)
    ctx = sparcrag.make_ctx(policy, tokenizer, retrievers, llm, args)
    ctx = with_naive_roles(sparcrag, ctx, policy, tokenizer, llm)
    depths, results = [int(d) for d in grid.grid_depths.split(",")], []
    for width in (int(w) for w in grid.grid_widths.split(",")):
        played = sparcrag.sparc_rag(rows, ctx, width, max(depths), early_exit=False, seed=args.seed)
        for depth in depths:
            records = [sparcrag.run_record(run, args, depth) for run in played]
            results.append({"system": f"SPARC-RAG W={width} D={depth}", **sparcrag.summarize(records, rows)})
    for spec in grid.naive.split(","):
        system, n = spec.split(":")
        played = naive(sparcrag, ctx, rows, system, int(n), args.seed)
        summary = sparcrag.summarize([sparcrag.run_record(run, args) for run in played], rows)
        results.append({"system": f"{system} (naive) n={n}", **summary})
    (out / "grid.json").write_text(json.dumps(results, indent=1))
    print(table(results, sorted(results[0]["groups"])))


if __name__ == "__main__":
    runs.run_main(main)
