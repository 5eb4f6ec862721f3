#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) and the Mimi switch bench in one device call (~5 min on one H200):
#   bash bench/h200_gpu_tests.sh COMMIT [OUT_DIR]
# Run it first in a device session, before bench/h200_all.sh: it checks every GPU path (kernels,
# transformer, CSM, Llama, Mimi, the served CSM and text tests) against its reference. Then
# bench/mimi.py times the Mimi decode step per switch (layout, window kernel or SDPA, full batch or
# served), with --tf32-check. Everything goes into one results.tgz (the device returns few files).
source bench/h200_run.sh "$0" "$@"

echo "== GPU tests"
# in parallel processes where pytest-xdist is there (the tests are mostly Triton compiles, on the CPU)
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_PROCS:-6}")
timeout "${GPU_TEST_TIMEOUT:-400}" python3 -m pytest -q -s -rs --durations=12 $xdist -m gpu tests/kernels tests/engines tests/codecs tests/server/test_csm_gpu.py \
  tests/server/test_text_server.py > "$work/gpu_tests.log" 2>&1
grep -E "passed|failed|error|FAILED|SKIPPED| ms (graph)|fused vs|^[0-9.]+s (call|setup)" "$work/gpu_tests.log" | cut -c1-200 | tail -40

echo "== Mimi switches"
timeout 120 python3 bench/mimi.py --tf32-check --profile --out "$work/mimi_h200.json" > "$work/mimi.log" 2>&1
grep "served, channels\|float32" "$work/mimi.log" | cut -c12-150

pack_results
