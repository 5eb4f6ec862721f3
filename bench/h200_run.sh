# The frame of a one-call device script (bench/h200_all.sh, bench/h200_gpu_tests.sh), sourced as
#   source bench/h200_run.sh "$0" "$@"        (then the script's steps write into "$work", then)
#   pack_results
# COMMIT (the first argument) labels the results: the device copy's own git may name another
# commit. OUT_DIR defaults to $OUT (the device tool's folder) or bench/results/run. Everything the
# steps write goes into one results.tgz, because the device tool returns only a few files a call.
set -u
export REALTIME_COMMIT="${2:?usage: $1 COMMIT [OUT_DIR]}"
out="${3:-${OUT:-bench/results/run}}"
mkdir -p "$out"
work="$(mktemp -d)"
source bench/h200_env.sh
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader

pack_results() {
  tar czf "$out/results.tgz" -C "$work" .
  echo "wrote $out/results.tgz ($(ls "$work" | tr '\n' ' '))"
}
