# Source this on a device machine that lacks some of our dependencies (e.g. the H200 image):
#   source bench/h200_env.sh
# Installs the wheels carried in .whl*/ (pip download --python-version 3.12 ... -d .whl) into .site/
# (kept between calls on a warm machine), puts .site and the tree on PYTHONPATH, and links the
# namespace subpackages (realtime.engines -> engines/, ...) the way the editable install does.
for w in .whl*/; do
  [ -d "$w" ] && ls "$w"*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site "$w"*.whl
done
export PYTHONPATH="$PWD/.site:$PWD" PYTHONUNBUFFERED=1
for d in engines codecs kernels clients; do ln -sfn "../$d" "realtime/$d"; done
