#!/usr/bin/env bash
# Download into .whl/ the wheels the GPU machines' image lacks for the server tests (fastapi, openai and
# what they import that the image does not hold or holds too old), at the versions installed here, for
# CPython 3.12 on x86-64. On the GPU machine, before the suite:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=.:/tmp/site; python -c "import fastapi, openai"
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn
openai jiter distro sniffio anyio idna httpx2 httpcore2 truststore opentelemetry-api"
rm -rf .whl && mkdir .whl
for name in $PACKAGES; do
    version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name${version:+==$version}"  # the newest where it is not installed here
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
du -sh .whl
