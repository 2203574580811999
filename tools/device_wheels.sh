#!/usr/bin/env bash
# Download the wheels the device stages install (Python 3.12, x86-64; git ignores these folders), so a fresh
# checkout can carry them: .whl (pytest-xdist, execnet, py-spy; GPU=1 adds ../shared/tools/gpu-wheels.sh's
# FlashInfer / Liger / xFormers), .whl_srv (the serve extra with its dependencies: fastapi, uvicorn, uvloop,
# httptools, pydantic, msgpack, pyzmq, httpx, aiohttp, ...), .whl_dec (the structured extra: xgrammar, llguidance,
# jsonschema). The device image has torch, numpy, transformers, prometheus-client; everything here is
# installed there with `pip install --no-index --no-deps --target /tmp/site`.
# Usage: tools/device_wheels.sh   (about 40 MB in all; the carried tree is limited to 64 MiB)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in .whl .whl_srv .whl_dec; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
dl() {  # dl DIR [--no-deps] REQ...: binary wheels for CPython 3.12 on manylinux x86-64
  local dir=$1; shift
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" "$@"
}
dl .whl --no-deps pytest-xdist execnet py-spy
if [ "${GPU:-0}" = 1 ]; then ../shared/tools/gpu-wheels.sh; fi
dl .whl_srv fastapi uvicorn uvloop httptools pydantic msgpack pyzmq httpx aiohttp
# the image has these already (and torch pins some): keep its copies
rm -f .whl_srv/typing_extensions-* .whl_srv/numpy-*
dl .whl_dec --no-deps xgrammar llguidance jsonschema jsonschema-specifications referencing rpds-py attrs
du -sh .whl .whl_srv .whl_dec
