# Source this on a device machine that lacks some of our dependencies (e.g. the H200 image):
#   source bench/h200_env.sh
# Installs the wheels carried in .whl*/ (pip download --python-version 3.12 ... -d .whl) into .site/
# (kept between calls on a warm machine), puts .site and the tree on PYTHONPATH, and links the
# namespace subpackages (realtime.engines -> engines/, ...) the way the editable install does.
#
# What the H200 image lacks, per bench (2026-12): every server bench: starlette, uvicorn, websockets,
# python-multipart, soundfile (+ cffi, pycparser), gguf, pytest-asyncio for the tests; bench/image.py:
# diffusers; bench/asr.py --device cuda: ctranslate2 (43 MB), silero-vad (the VAD weights) and the
# tiny.en model folder (75 MB) — more than one call carries (64 MiB), so send the model in two
# consecutive calls and keep the first part in the machine's /tmp (it survives between calls while
# the machine is warm; ignored folders inside the tree do not).
for w in .whl*/; do
  [ -d "$w" ] && ls "$w"*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site "$w"*.whl
done
export PYTHONPATH="$PWD/.site:$PWD" PYTHONUNBUFFERED=1
for d in engines codecs kernels clients; do ln -sfn "../$d" "realtime/$d"; done
