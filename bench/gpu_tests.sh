#!/usr/bin/env bash
# The test suite on a GPU machine with a bare image (its CUDA paths: bf16 autocast, the GPU-marked tests):
#   bash bench/gpu_tests.sh [OUT] [PYTEST ARGS...]   (logs under OUT, default /tmp/gpu_tests; default: every test file)
# One pytest worker per file (pytest-xdist, --dist loadfile: each file's tests in its own order, as in CI). faiss-cpu
# and bm25s come from wheels in .whl/ when the machine has no package index; subprocess tests inherit PYTHONPATH.
# The failure report comes last: give the call the time to print it (the whole suite took over 4 minutes at -n 8).
set -u
out=${1:-${OUT:-/tmp/gpu_tests}}
shift $(($# > 0 ? 1 : 0))
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ! python3 -c "import faiss, bm25s" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
spread=()  # pytest-xdist where installed (the GPU image has it): half the cores, at most 8 workers
if python3 -c "import xdist" 2>/dev/null; then
    spread=(-n "$(python3 -c "import os; print(min(8, os.cpu_count() // 2 or 1))")" --dist loadfile)
fi
python3 -m pytest -q -p no:cacheprovider "${spread[@]}" -rfs --durations=15 "${@:-tests}" 2>&1 | tee "$out/pytest.log"
