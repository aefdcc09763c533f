#!/usr/bin/env bash
# Download into wheels/ (git-ignored) what structured outputs need on the GPU machines (CPython 3.12,
# no network) beyond their image: xgrammar and apache-tvm-ffi, and pydantic with its own requirements
# (the image holds torch, triton, numpy and transformers; KINDS.md's package list). At the versions
# installed here; about 8 MB, so that it fits beside the tree in a call's 64 MiB. Carry: wheels
# scripts/gpu/firsthour.sh installs them with `pip install --no-index --no-deps --target`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PACKAGES="xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection typing_extensions"
rm -rf wheels && mkdir wheels
for name in $PACKAGES; do
    version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels "$name${version:+==$version}"
done
du -sh wheels
