# Sourced by the bench/gpu_*.sh scripts: install the carried wheels ($KOPT_WHEELS, default .whl; see
# ../shared/tools/gpu-wheels.sh) beside the machine's torch and put kopt on the path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${KOPT_WHEELS:-.whl}/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 KOPT_HOME=/tmp/kopt-home
