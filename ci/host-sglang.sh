#!/usr/bin/env bash
# Host integration: the atom-sglang-plugin tests against the real, released SGLang.
#
# Creates (once, then reuses) a virtual environment with the system python3.11, pip and the full
# sglang==0.5.23 (its own pins: torch 2.14.1, transformers 5.19.0, flashinfer, sgl-kernel, ...;
# ~11 GB, ~7 minutes cold), installs the freshly built ATOM wheels into it, and runs
# packages/atom-sglang-plugin/tests there. The full install, not a `--no-deps` subset: SGLang's
# model loader, logits processor and memory pools import its CUDA-side packages at module level,
# and the full install is the environment users have. The workspace's own `uv run pytest` never
# collects those tests (there is no SGLang in the workspace environment).
#
#   ATOM_HOST_ENV_DIR     where the cached environments live (default: ~/.cache/atom-ci)
#   ATOM_SGLANG_VERSION   the SGLang release to test against (default: 0.5.23)
#   --prepare             only create the environment (when missing) and stop; .ci/run does this
#                         in the background while the workspace's own tests run
#   extra arguments       are passed to pytest (e.g. -k logits -x)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"

sglang_version=${ATOM_SGLANG_VERSION:-0.5.23}
env_dir="${ATOM_HOST_ENV_DIR:-$HOME/.cache/atom-ci}/sglang-$sglang_version"
marker="$env_dir/.atom-complete"
py="$env_dir/bin/python"
start=$SECONDS

pip() {  # quiet pip in the environment, without this machine's notes on absent local index folders
    "$py" -m pip -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ ! -f "$marker" ]]; then
    echo "host-sglang: creating $env_dir (sglang==$sglang_version; ~11 GB, takes minutes)"
    rm -rf "$env_dir"
    mkdir -p "$(dirname "$env_dir")"
    python3.11 -m venv "$env_dir"
    pip install --upgrade pip
    pip install "sglang==$sglang_version" pytest
    "$py" -c "import sglang, torch; print('host-sglang: sglang', sglang.__version__, 'torch', torch.__version__)"
    touch "$marker"
    echo "host-sglang: environment ready in $((SECONDS - start)) s"
else
    echo "host-sglang: reusing $env_dir"
fi
if [[ "${1:-}" == "--prepare" ]]; then
    exit 0
fi

# Fresh ATOM wheels, built without workspace sources; installed without dependencies so the
# environment's torch (SGLang's pin) is never replaced (SGLang already brings gguf, safetensors).
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
uv build -q --all-packages --no-sources --wheel -o "$dist"
pip install --no-deps --force-reinstall \
    "$dist"/atom_kernels-*.whl "$dist"/atom_models-*.whl "$dist"/atom_sglang_plugin-*.whl

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
# Run from a neutral directory so the workspace sources never shadow the installed wheels;
# the root pytest config still applies (markers, import mode) through -c / --rootdir.
# SGLang's own dependencies emit DeprecationWarnings by the dozen at import: not ours to fix.
cd "$dist"
status=0
"$py" -m pytest "$root/packages/atom-sglang-plugin/tests" -c "$root/pyproject.toml" \
    --rootdir "$root" -p no:cacheprovider -W ignore::DeprecationWarning \
    -o addopts="--import-mode=importlib --strict-markers -ra" "$@" || status=$?
echo "host-sglang: finished in $((SECONDS - start)) s"
exit $status
