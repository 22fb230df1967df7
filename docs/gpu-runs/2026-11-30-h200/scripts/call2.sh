#!/bin/bash
# The second device call: FA4 (its cutlass compiler piece left by the first call in .fa4a),
# then the training runs and fp8 (make gpu-bench without the gradients and sampling).
set -o pipefail
W=/tmp/knapray-gpu-wheels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
mv .fa4a/*.tar.xz .whlb/ 2>/dev/null && echo "FA4's compiler piece: kept from the first call" || echo "FA4's compiler piece: gone (a fresh machine)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W .whlb/*.whl 2>&1 | grep -v "as the 'root' user"
for a in .whlb/*.tar.xz; do [ ! -f "$a" ] || tar -xJf "$a" -C $W; done
P=$(python3 -c 'import site,sys; d=sys.argv[1]; o=list(sys.path); site.addsitedir(d); print(":".join([d]+[p for p in sys.path if p not in o and p!=d]))' $W)
echo "PYTHONPATH=$P"
if ! PYTHONPATH=$P:. timeout 120 python3 .gpucall/fa4_smoke.py 2>&1 | tail -12; then
  echo "== FA4 left out: its smoke check failed"; rm -f .whlb/flash_attn_4*.whl; rm -rf $W/flash_attn $W/flash_attn_4*
fi
PYTHONPATH=$P:. timeout 100 python3 -m knapray.cli bench kernels --hidden 5120 --heads 40 --seq-lens 32760 2>&1 | tee $OUT/kernels-wan.log
PYTHON=python3 GPU_WHEELS=.whlb GPU_BENCH_JSON=$OUT/bench.json GPU_BENCH_TIMEOUT=${BENCH_S:-420} \
  GPU_BENCH_FLAGS="--skip gradients --skip sampling --only fsdp-compile --only fsdp-compile-sac" make gpu-bench 2>&1 | tee $OUT/bench.log
