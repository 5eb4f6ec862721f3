#!/usr/bin/env bash
# The speech and text benchmarks of BENCHMARKS.md in one device call (~6-8 min on one H200; the HF static-cache generate alone took 67 s once):
#   bash bench/h200_all.sh COMMIT [OUT_DIR]
# 1. bench/csm_engine.py: CSM-1B frames/s at batch 1/8/64 next to HF transformers (eager, static
#    cache) on the same random-weight checkpoint, Mimi decode, prefill, and a kernel profile.
# 2. bench/tts.py: the real server on loopback. TTFA for three prompts, then an open-loop concurrency
#    sweep of 1..256 streams (underruns, GC pauses). It writes a JSON and the PNG plot.
# 3. bench/text.py: Llama-3.2-1B shapes, batch 1/8/32/128, read-each-step and pipelined, next to HF;
#    then sampled decoding (temperature 1, the API default) at batch 1/8/128.
# COMMIT, OUT_DIR and the one results.tgz: see bench/h200_run.sh. PARTS (env) picks a subset,
# e.g. PARTS="text csm" (default: csm tts text), to split the run over two calls when one would
# pass the device's 10-minute limit. CSM_BATCHES (default "1 8 64") and CSM_TIMEOUT (300 s) trim the CSM part;
# TEXT_SAMPLED=0 leaves the text part's sampled rows out. Part "advance" (not in the default): the GPU tests of
# the one-launch token pick (on by default; REALTIME_TEXT_ADVANCE=0 turns it off) (kernels/sampling.advance_rows), then bench/text.py --advance-ab.
# STACK=cuda runs the csm and text parts' engines with the CUDA C++ decode stack (REALTIME_STACK=csm or
# text, REALTIME_STACK_KERNEL=cuda: one-row steps, so batch 1); the served tts part keeps the layer path
# (the stack's persistent kernel would wait on the codec's kernels beside it).
# REALTIME_STACK_INFLIGHT (env, passed through) sets the stack's weight copies in flight an SM (default 2).
# REALTIME_STACK_L2_KEEP (env, passed through): CSM keeps every k-th stage of its depth layers in L2, the
# rest of the weights stream evict_first (default: auto, k from the GPU's L2; 0: no L2 hints).
source bench/h200_run.sh "$0" "$@"
parts="${PARTS:-csm tts text}"
stack_env() {  # the variables that put engine $1 on the CUDA stack, or none
  if [ "${STACK:-}" = cuda ]; then echo "REALTIME_STACK=$1 REALTIME_STACK_KERNEL=cuda"; fi
}
[ -n "${STACK:-}" ] && [ "$STACK" != cuda ] && { echo "STACK must be cuda or unset, got '$STACK'" >&2; exit 2; }

# Part "scan" (with STACK=cuda): bench/stack_ab.py's copies in flight and burst, alternating in one
# process a stack (SCAN_TEXT and SCAN_CSM: its settings, the first the reference), and the parts after
# it run at each scan's best setting (bench/stack_ab.py --best: the variables, printed here; none
# where a setting changed a result). E.g. PARTS="scan text" on a GPU the defaults were not measured on.
csm_env="" text_env=""
if [[ " $parts " == *" scan "* ]]; then
[ "${STACK:-}" = cuda ] || { echo "PARTS=scan needs STACK=cuda" >&2; exit 2; }
for part in text csm; do
  [[ " $parts " == *" $part "* ]] || continue
  if [ $part = text ]; then settings="${SCAN_TEXT:--1:2 -1:3 -1:4 -1:2+0 -1:2+5 -1:2 -1:3 -1:4 -1:2+0 -1:2+5}"
  else settings="${SCAN_CSM:-auto:2 auto:3 auto:4 auto:2+3 auto:2 auto:3 auto:4 auto:2+3}"; fi
  echo "== scan: $part, $settings"
  env $(stack_env $part) timeout "${SCAN_TIMEOUT:-200}" python3 bench/stack_ab.py $part --steps 512 --settings $settings \
    --out "$work/stack_ab_${part}_scan.json" --plot "$work/stack_ab_${part}_scan.png" > "$work/scan_$part.log" 2>&1
  grep -E "in flight|rror" "$work/scan_$part.log" | cut -c1-190
  best=$(python3 bench/stack_ab.py --best "$work/stack_ab_${part}_scan.json") && echo "$part runs at: $best" || best=""
  if [ $part = text ]; then text_env="$best"; else csm_env="$best"; fi
done
fi

if [[ " $parts " == *" advance "* ]]; then  # advance_rows GPU tests, then its A/B (torch ops, then one launch)
echo "== advance_rows: GPU tests"
timeout 200 python3 -m pytest -q -rs -s -m gpu tests/kernels/test_kernels.py -k advance_rows > "$work/advance_tests.log" 2>&1
env $(stack_env text) timeout 200 python3 -m pytest -q -rs -m gpu tests/server/test_text_server.py tests/engines/test_llama.py \
  -k "cuda_graph_step or same_run_after_run" >> "$work/advance_tests.log" 2>&1
grep -E "passed|failed|error|FAILED|advance_rows V" "$work/advance_tests.log" | cut -c1-200
echo "== advance_rows: text A/B, greedy then sampled (temperature 1)"
env $(stack_env text) timeout 150 python3 bench/text.py --batches 1 8 128 --no-hf --advance-ab --profile \
  --out "$work/text_advance_h200.json" > "$work/text_advance.log" 2>&1
env $(stack_env text) timeout 90 python3 bench/text.py --batches 1 128 --no-hf --advance-ab --temperature 1.0 \
  --out "$work/text_advance_sampled_h200.json" >> "$work/text_advance.log" 2>&1
grep -E "^ours|same tokens|device-only" "$work/text_advance.log" | cut -c1-160
fi

if [[ " $parts " == *" csm "* ]]; then
echo "== CSM engine (builds a random CSM-1B in /tmp/csm1b on first use)"
env $(stack_env csm) $csm_env timeout "${CSM_TIMEOUT:-300}" python3 bench/csm_engine.py --folder /tmp/csm1b --batches ${CSM_BATCHES:-1 8 64} --variants graphed_kernels \
  --frames 48 --out "$work/csm_engine_h200.json" > "$work/csm_engine.log" 2>&1
grep "^\[" "$work/csm_engine.log" | grep -v "GEMV choice" | grep "frames/s\|codes on\|Mimi\|HF" | cut -c1-170
fi

if [[ " $parts " == *" tts "* ]]; then
echo "== served TTS sweep"
timeout 240 python3 bench/tts.py --tts-model /tmp/csm1b --generator-device cuda:0 --codec-device cuda:0 \
  --dtype bfloat16 --slots 256 --prompts hello short reference --rounds 10 --warmup 3 --sweep-prompt short \
  --concurrency 1 8 32 64 128 256 --client-procs 8 --out "$work/tts_csm_h200.json" \
  --plot "$work/tts_csm_h200.png" > "$work/tts.log" 2>&1
grep -v "INFO\|Loading" "$work/tts.log" | tail -16
fi

if [[ " $parts " == *" text "* ]]; then
echo "== text decode"
env $(stack_env text) $text_env timeout 200 python3 bench/text.py --profile --out "$work/text_h200.json" > "$work/text.log" 2>&1
grep -v "GEMV choice" "$work/text.log" | grep "^ours\|^hf\|floor\|device-only\|parity" | tail -20

if [ "${TEXT_SAMPLED:-1}" != 0 ]; then  # TEXT_SAMPLED=0: greedy rows only (a shorter call)
echo "== text decode, sampled (temperature 1, no top-k/top-p: the API default)"
env $(stack_env text) $text_env timeout 90 python3 bench/text.py --temperature 1.0 --batches 1 8 128 --no-hf --out "$work/text_h200_sampled.json" \
  > "$work/text_sampled.log" 2>&1
grep "^ours" "$work/text_sampled.log"
fi
fi

pack_results
