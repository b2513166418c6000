#!/usr/bin/env bash
# Build all five wheels without workspace sources, then install each one ALONE (with only its
# declared dependencies; siblings come from the freshly built wheels, never from the workspace)
# into a fresh virtual environment and import it. A wheel that secretly needs an undeclared
# sibling fails here.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
dist="$root/dist"
rm -rf "$dist"
uv build --all-packages --no-sources --wheel -o "$dist" -q
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for wheel in "$dist"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1)        # e.g. atom_models
    env="$work/$name"
    uv venv -q --python 3.11 "$env"
    # --find-links offers the sibling wheels; only those declared as dependencies get installed.
    # --refresh-package: the same version number was built before; never reuse a cached copy.
    uv pip install -q --python "$env/bin/python" --find-links "$dist" \
        $(for p in atom-kernels atom-models atom-engine atom-vllm-plugin atom-sglang-plugin; do
            echo --refresh-package "$p"; done) "$wheel"
    # Import the package and every module in it: a lazy import of an undeclared sibling fails too.
    # Modules that need a host (vLLM, SGLang) declare it in their docstring's first line with
    # "[host: <package>]" and are skipped when that host is absent.
    if "$env/bin/python" - "$name" <<'PY'
import importlib, importlib.util, pkgutil, sys
name = sys.argv[1]
pkg = importlib.import_module(name)
count = 0
for info in pkgutil.walk_packages(pkg.__path__, name + "."):
    spec = importlib.util.find_spec(info.name)
    source = open(spec.origin).read() if spec and spec.origin else ""
    host = source.split("[host: ", 1)[1].split("]", 1)[0] if "[host: " in source[:500] else None
    if host and importlib.util.find_spec(host) is None:
        continue
    importlib.import_module(info.name)
    count += 1
print(f"{name} {pkg.__version__}: imports alone ({count} modules)")
PY
    then
        :
    else
        echo "FAILED: $name does not import with only its declared dependencies" >&2
        status=1
    fi
done
exit $status
