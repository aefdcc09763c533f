#!/usr/bin/env bash
# Download into wheels/ (git-ignored) what structured outputs need on the GPU machines (CPython 3.12,
# no network): xgrammar and what it imports that a torch image may lack (transformers and its own
# requirements), at the versions installed here. torch, triton and numpy are left to the image.
# scripts/gpu/firsthour.sh installs them with `pip install --no-index --find-links wheels/`, so a
# package the image already holds at an accepted version is kept. Carry: wheels
set -euo pipefail
cd "$(dirname "$0")/../.."
PACKAGES="xgrammar apache-tvm-ffi transformers huggingface_hub tokenizers safetensors regex pyyaml tqdm packaging
filelock fsspec hf-xet httpx2 httpcore2 h11 anyio idna sniffio certifi truststore opentelemetry-api importlib-metadata zipp
click typer rich markdown-it-py mdurl pygments
shellingham annotated-doc kernels tomlkit pydantic pydantic_core annotated-types typing-inspection typing_extensions"
rm -rf wheels && mkdir wheels
for name in $PACKAGES; do
    version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d wheels "$name${version:+==$version}"
done
du -sh wheels
