# Sourced from the repo root on the device machine: `. benchmarks/device_env.sh`. Installs the
# wheels the GPU image lacks (.whl, filled here by ../shared/device/fetch-wheels.sh; README) into
# /tmp/site and puts them and the five packages' src on PYTHONPATH; points the tests at the
# bundled tokenizer (.bench_assets/tokenizer) when it was carried. run_gpu.sh and the *_ab.sh
# scripts source it; a script run alone needs it first.
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$(ls -d packages/*/src | paste -sd:):${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The tests' tiny checkpoints take the bundled tokenizer; its package is not on the GPU image.
if [ -d .bench_assets/tokenizer ]; then export ATOM_TEST_TOKENIZER=$PWD/.bench_assets/tokenizer; fi
