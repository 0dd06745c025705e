#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one command, for a GPU machine with a bare image:
#   bash bench/gpu_session.sh [OUT]      (figures and a log under OUT, default /tmp/gpu_session)
# Each part runs as its own process under a time limit, so one failure (out of memory, say) leaves the others'
# figures. faiss-cpu and bm25s come from wheels in .whl/ when the machine has no package index (see docs).
# On one H200 (2026-11-26) the three paper-shape parts took 79 + 48 + 103 s; the 1M-passage index part needs about
# 6 minutes more (encoding alone 218 s):
# under a 10-minute limit it stops after the Flat index.
set -u
out=${1:-${OUT:-/tmp/gpu_session}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true
if [ -d .whl ] && ! python3 -c "import faiss" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
log="$out/log.txt"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers, accelerate, peft, faiss; print('torch', torch.__version__,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__,
'faiss', faiss.__version__)"
} >>"$log" 2>&1
part() {  # part NAME SECONDS COMMAND...: run, log, time it
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*" >>"$log"
    timeout "$limit" "$@" >>"$log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s" >>"$log"
}
part sparkle 130 python3 bench/paper_shapes.py --method sparkle --shape qwen2.5-3b --steps 2 --json "$out/sparkle.json"
part tearag 130 python3 bench/paper_shapes.py --method tearag --shape llama3-8b --steps 2 --json "$out/tearag.json"
part sparcrag 120 python3 bench/paper_shapes.py --method sparcrag --shape qwen2.5-7b --steps 2 --json "$out/sparcrag.json"
part index $((550 - SECONDS)) python3 bench/index_scale.py --passages 1000000 --json "$out/index.json"  # the time left
tail -n 3 "$log"
