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
    uv pip install -q --python "$env/bin/python" --find-links "$dist" "$wheel"
    if "$env/bin/python" -c "import $name, sys; print('$name', $name.__version__, 'imports alone')"; then
        :
    else
        echo "FAILED: $name does not import with only its declared dependencies" >&2
        status=1
    fi
done
exit $status
