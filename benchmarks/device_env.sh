# Sourced by the device scripts (gpu_check.sh, per_gpu.sh, refine_side_by_side.sh) from the
# repository root: the device machine's Python lacks a numpy that numba-cuda takes, so the
# wheel carried in .whl/ (shared/DEVICE.md) goes to /tmp/site once; several scripts started
# together (per_gpu.sh) find it there. Where no wheel is carried (a machine with its own
# numpy) nothing installs.
if [[ ! -d /tmp/site/numpy ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
fi
export PYTHONPATH=/tmp/site:$PWD
