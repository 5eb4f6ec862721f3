#!/usr/bin/env bash
# The one-kernel decode step (kernels/decode_stack.py, REALTIME_STACK) on the H200, in one device call
# (~6-8 min): its GPU tests first (a hang is cut by the timeout, and the benches are skipped), then
# text decode and the CSM frame with the stack off and on, side by side (same weights, same call):
#   bash bench/h200_stack.sh COMMIT [OUT_DIR]
source bench/h200_run.sh "$0" "$@"

echo "== GPU tests of the stack kernel"
if timeout "${STACK_TEST_TIMEOUT:-240}" python3 -m pytest -q -x -rs -m gpu tests/kernels/test_decode_stack.py \
     tests/engines/test_transformer_kernels.py > "$work/stack_tests.log" 2>&1; then
  tail -3 "$work/stack_tests.log"
  for s in 0 text; do
    echo "== text decode, REALTIME_STACK=$s"
    REALTIME_STACK=$s timeout 170 python3 bench/text.py --batches 1 4 32 --no-hf --profile \
      --out "$work/text_stack_$s.json" > "$work/text_stack_$s.log" 2>&1
    grep -v "GEMV choice" "$work/text_stack_$s.log" | grep "^ours\|device-only\|floor" | cut -c1-170 | tail -8
  done
  for s in 0 csm; do
    echo "== CSM engine, REALTIME_STACK=$s"
    REALTIME_STACK=$s timeout 200 python3 bench/csm_engine.py --folder /tmp/csm1b --batches 1 4 --variants graphed_kernels \
      --frames 48 --out "$work/csm_stack_$s.json" > "$work/csm_stack_$s.log" 2>&1
    grep "^\[" "$work/csm_stack_$s.log" | grep -v "GEMV choice" | grep "frames/s\|codes on" | cut -c1-170
  done
else
  echo "stack GPU tests failed or timed out: no benches"
  grep -E "passed|failed|Error|error|assert" "$work/stack_tests.log" | cut -c1-200 | tail -30
fi
pack_results
