#!/usr/bin/env bash
# Adds to .device/extra the wheels fa4gen needs on the GPU machine beyond ../shared/device/pack.sh
# (its image has no pydantic). Run from the project root on the dev machine.
set -euo pipefail
mkdir -p .device/extra
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .device/extra pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
  typing_extensions==4.15.0
# The carry limit is 64 MiB (tracked files + .device): the anchors' torch_c_dlpack_ext wheel (0.9 MB)
# is left out. flash-attn-4 and fa4gen import and run without it (session 5, calls 3-9); it only
# speeds up tvm-ffi's DLPack exchange, so host-overhead numbers (tools/launch_cost.py) should be
# measured with it: put it back for that call and drop something else, or measure in a separate call.
if [ -d .device/anchors ]; then chmod u+w .device/anchors && rm -f .device/anchors/torch_c_dlpack_ext-*.whl; fi
