# Sourced by the GPU scripts that need structured outputs' packages beyond the GPU image (xgrammar and its
# requirements): installs the carried wheels (built by scripts/gpu/firsthour_wheels.sh; carry `wheels`) into
# /tmp/site_wheels, puts them on PYTHONPATH and writes the versions to $OUT/versions.txt. Exits the caller
# when the wheels are missing.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_wheels \
  wheels/*.whl || exit 1
export PYTHONPATH=.:/tmp/site_wheels
python3 -c "import importlib.metadata as m, torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'xgrammar', m.version('xgrammar'))" | tee "$OUT/versions.txt"
