#!/usr/bin/env bash
# The one-kernel decode step (kernels/decode_stack.py, REALTIME_STACK) on the H200, in one device call:
# its GPU tests first (a hang is cut by the timeout, and the benches are skipped), then the stack's
# variants and phases (bench/stack_probe.py), then text decode and the CSM frame with the stack off
# and on, side by side (same weights, same call):
#   PARTS="probe text csm ncu" bash bench/h200_stack.sh COMMIT [OUT_DIR]
# STACK_TESTS=0 skips the tests (already passed at this commit); PROBE_ARGS, CSM_ARGS pass flags
# (--quick, --skip-hf); STACK_TUNE sets the stack's switches for text and csm (REALTIME_STACK_TUNE,
# e.g. "FMA=10,ATT_REGS=1"); STACK_KERNEL=cuda runs the CUDA C++ stack instead (REALTIME_STACK_KERNEL). PARTS picks the steps after the tests (probe, text, csm by default: ~9 min,
# more than one call allows on a cold machine; "probe text" and "csm" fit one call each; ncu; ncu_cuda:
# the CUDA C++ stack under Nsight Compute with per-instruction samples, report and CSVs in the results;
# bench/ncu_lines.py sums them per source line here).
source bench/h200_run.sh "$0" "$@"
parts="${PARTS:-probe text csm}"
has() { [[ " $parts " == *" $1 "* ]]; }

echo "== GPU tests of the stack kernel"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
if [ "${STACK_TESTS:-1}" = 0 ] || timeout "${STACK_TEST_TIMEOUT:-200}" python3 -m pytest -q -x -rs $xdist -m gpu tests/kernels/test_decode_stack.py tests/kernels/test_decode_stack_cuda.py \
     tests/engines/test_transformer_kernels.py > "$work/stack_tests.log" 2>&1; then
  [ -f "$work/stack_tests.log" ] && tail -3 "$work/stack_tests.log"
  if has probe; then
    for shapes in ${PROBE_SHAPES:-1b}; do  # 1b (Llama-3.2-1B) and/or csm-depth (CSM's depth decoder)
      echo "== stack probe ($shapes shapes, batch 1)"
      timeout "${PROBE_TIMEOUT:-150}" python3 bench/stack_probe.py ${PROBE_ARGS:-} --shapes "$shapes" --out "$work/stack_probe_$shapes.json" \
        2>&1 | tee "$work/stack_probe_$shapes.log" | cut -c12-160
    done
  fi
  if has text; then
    for s in 0 text; do
      echo "== text decode, REALTIME_STACK=$s"
      REALTIME_STACK=$s REALTIME_STACK_TUNE="${STACK_TUNE:-}" REALTIME_STACK_KERNEL="${STACK_KERNEL:-triton}" timeout "${TEXT_TIMEOUT:-120}" python3 bench/text.py --batches 1 --no-hf --profile \
        --out "$work/text_stack_$s.json" > "$work/text_stack_$s.log" 2>&1
      grep -v "GEMV choice" "$work/text_stack_$s.log" | grep "ours-\|device-only\|floor\|_stack_kernel" \
        | cut -c1-170 | tail -10
    done
  fi
  if has ncu; then  # Nsight Compute: where the stack kernel's warps stall, next to one layer of the layer path
    sec="--section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
    echo "== ncu: the stack kernel"
    timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none --nvtx --nvtx-include "stack/" -k regex:_stack_kernel -c 1 $sec \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 bench/stack_probe.py --ncu > "$work/ncu_stack.log" 2>&1
    grep -v "^\[\|^==PROF==" "$work/ncu_stack.log" | grep -v "^ *-* *$" | cut -c1-150 | head -120
    echo "== ncu: one layer of the layer-by-layer step"
    timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none --nvtx --nvtx-include "layers/" -c 9 --section SpeedOfLight \
      --section WarpStateStats python3 bench/stack_probe.py --ncu > "$work/ncu_layers.log" 2>&1
    grep -E "^  [a-z_]|Duration|Memory Throughput|DRAM Throughput|Stall|Warp Cycles Per Issued" "$work/ncu_layers.log" \
      | cut -c1-150 | head -80
  fi
  if has ncu_cuda; then  # Nsight Compute on the CUDA C++ stack: where its warps stall, line by line
    echo "== ncu: the CUDA stack (source counters; the SASS page in ncu_cuda_sass.csv, all metrics in ncu_cuda_raw.csv)"
    REALTIME_CUDA_LINEINFO=1 timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none --nvtx --nvtx-include "cuda_stack/" \
      -k regex:stack_kernel -c 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
      --import-source yes -o "$work/ncu_cuda" python3 bench/stack_probe.py --ncu-cuda > "$work/ncu_cuda.log" 2>&1
    tail -5 "$work/ncu_cuda.log"
    # the SASS page carries the samples (the CUDA page has no metrics); bench/ncu_lines.py puts them on source lines
    ncu -i "$work/ncu_cuda.ncu-rep" --page source --csv --print-source sass > "$work/ncu_cuda_sass.csv" 2>&1
    ncu -i "$work/ncu_cuda.ncu-rep" --page raw --csv > "$work/ncu_cuda_raw.csv" 2>&1
    ncu -i "$work/ncu_cuda.ncu-rep" --section WarpStateStats --section SpeedOfLight 2>&1 | grep -v "^ *-* *$" | cut -c1-150 | head -60
    head -c 300 "$work/ncu_cuda_sass.csv"; echo
  fi
  if has csm; then
    for s in 0 csm; do
      echo "== CSM engine, REALTIME_STACK=$s"
      REALTIME_STACK=$s REALTIME_STACK_TUNE="${STACK_TUNE:-}" REALTIME_STACK_KERNEL="${STACK_KERNEL:-triton}" timeout "${CSM_TIMEOUT:-150}" python3 bench/csm_engine.py ${CSM_ARGS:-} --folder /tmp/csm1b --batches 1 \
        --variants graphed_kernels --frames 48 --out "$work/csm_stack_$s.json" > "$work/csm_stack_$s.log" 2>&1
      grep "^\[" "$work/csm_stack_$s.log" | grep -v "GEMV choice" | grep "frames/s\|codes on\|sampler choice" | cut -c1-300
    done
  fi
else
  echo "stack GPU tests failed or timed out: no benches"
  grep -E "passed|failed|Error|error|assert" "$work/stack_tests.log" | cut -c1-200 | tail -30
fi
pack_results
