#!/bin/bash
# Fourth device call: FA4 installed from .whlb plus the compiler piece left by call 3; its
# smoke check, then the kernel bench at Flux's width (4 x 4293 tokens) with FA4 beside FA2.
set -o pipefail
exec > >(tee $OUT/call4.log) 2>&1
W=/tmp/fa4-wheels
mv .fa4a/*.tar.xz .whlb/ 2>/dev/null && echo "FA4's compiler piece: kept" || echo "FA4's compiler piece: gone (a fresh machine)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W .whlb/*.whl 2>&1 | grep -v "as the 'root' user"
for a in .whlb/*.tar.xz; do [ ! -f "$a" ] || tar -xJf "$a" -C $W; done
P=$(python3 -c 'import site,sys; d=sys.argv[1]; o=list(sys.path); site.addsitedir(d); print(":".join([d]+[p for p in sys.path if p not in o and p!=d]))' $W)
echo "PYTHONPATH=$P"
PYTHONPATH=$P:. timeout 90 python3 .gpucall/fa4_smoke.py 2>&1 | tail -30
PYTHONPATH=$P:. timeout 60 python3 -m knapray.cli bench kernels --hidden 3072 --heads 24 --seq-lens 4293,4293,4293,4293 2>&1
echo "call4 done"
