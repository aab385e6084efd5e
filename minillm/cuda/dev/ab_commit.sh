#!/usr/bin/env bash
# This checkout against the commit before it, on one GPU, in one call of at most 10 minutes
# (minillm/cuda/dev/ab_commit.py: logits bit for bit, decode tok/s and TTFT in alternating rounds, bench serve).
#   here:   mkdir .base && git archive <commit before> | tar -x -C .base      (it travels with the tree)
#   there:  bash minillm/cuda/dev/ab_commit.sh [ab_commit.py's options: --rounds, --shapes, --serve-runs ...]
# BASE (default .base) names the baseline checkout, PYTHON (default python3) the interpreter; the output is
# printed and kept in $OUT/ab_commit.log. Exit status 1 when any logits differ.
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/ab_commit}; mkdir -p "$OUT"
BASE=${BASE:-.base}
[ -f "$BASE/minillm/cuda/gpu_model.py" ] || { echo "ab_commit.sh: no baseline checkout at $BASE" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader 2>&1
"${PYTHON:=python3}" -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" 2>&1
echo "new: $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-100) (+ uncommitted changes, if any)"
PYTHONUNBUFFERED=1 "$PYTHON" minillm/cuda/dev/ab_commit.py --base "$BASE" --new . --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/ab_commit.log"
exit "${PIPESTATUS[0]}"
