#!/bin/bash
set -o pipefail
exec > >(tee $OUT/call5.log) 2>&1
W=/tmp/knapray-gpu-wheels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W .whla/*.whl 2>&1 | grep -v "as the 'root' user"
PYTHONPATH=$W:. PYTHONUNBUFFERED=1 timeout ${S:-250} python3 .gpucall/call5.py
