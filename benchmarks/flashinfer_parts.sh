#!/usr/bin/env bash
# FlashInfer on the GPU machine (issue 42). Its wheel (flashinfer-python 0.7.2.post1, the version
# vLLM 0.33 pins: 62 MB) plus the project's tree is over one device call's 64 MiB, so it travels
# in ~30 MiB parts over successive calls to one warm machine and is joined there.
#
#   here:       bash benchmarks/flashinfer_parts.sh split [DIR_WITH_THE_WHEEL]
#     downloads the wheel (unless DIR holds it), splits it into .fi_parts/partNN with a manifest
#     (.fi_parts/manifest: the wheel's name, its sha256 and the number of parts), and fetches its
#     one small dependency the GPU image lacks into .whl (../shared/device/fetch-wheels.sh).
#   on the GPU: bash benchmarks/flashinfer_parts.sh join
#     appends each carried part into $FI_PARTS_DIR (default /tmp/fi-parts, outside the repo copy:
#     it stays while the machine stays warm), and once all are there checks the sha256 and
#     installs the wheel into /tmp/site (pip --no-deps). Exit 0 once installed, 3 while parts are
#     still missing (say which), 1 on a bad checksum. Run the lead's command list in
#     benchmarks/README.md ("FlashInfer on the device").
#
# Dependencies (Requires-Dist of 0.7.2.post1): on the GPU image already (KINDS.md, 2026-11-17):
# torch, numpy, click, cuda-bindings (cuda-python's payload), einops, ninja, nvidia-ml-py,
# packaging, requests, tabulate, tqdm, filelock. Missing and needed at run time: apache-tvm-ffi
# (jit/core.py imports it; 0.1.15.post2, the version xgrammar pins here, meets <0.2,>=0.1.11).
# Missing and left out: nvidia-cutlass-dsl, nvidia-cudnn-frontend, cuda-tile, nccl4py,
# nccl-extensions (CuTe-DSL / cuDNN / NCCL paths this benchmark does not take; `import flashinfer`
# succeeds without them, checked on the CPU here with pynvml added).
set -euo pipefail
VERSION=0.7.2.post1
WHEEL=flashinfer_python-$VERSION-py3-none-any.whl
PART_SIZE=30M
mode=${1:-}
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
parts=.fi_parts

case $mode in
split)
    src=${2:-}
    mkdir -p "$parts"
    rm -f "$parts"/part* "$parts"/manifest
    if [ -n "$src" ] && [ -f "$src/$WHEEL" ]; then
        cp "$src/$WHEEL" "$parts/$WHEEL"
    else
        python3 -m pip download -q --no-deps "flashinfer-python==$VERSION" -d "$parts"
    fi
    sum=$(sha256sum "$parts/$WHEEL" | cut -d' ' -f1)
    (cd "$parts" && split -b "$PART_SIZE" -d -a 2 "$WHEEL" part && rm "$WHEEL")
    n=$(ls "$parts"/part* | wc -l)
    printf 'wheel=%s\nsha256=%s\nparts=%s\n' "$WHEEL" "$sum" "$n" > "$parts/manifest"
    ../shared/device/fetch-wheels.sh apache-tvm-ffi==0.1.15.post2 >/dev/null
    ls -l "$parts"
    echo "carry one part per call, with .fi_parts/manifest; .whl (9 MiB) with the last part"
    ;;
join)
    dir=${FI_PARTS_DIR:-/tmp/fi-parts}
    mkdir -p "$dir"
    [ -f "$parts/manifest" ] || { echo "join: $parts/manifest was not carried" >&2; exit 1; }
    cp "$parts/manifest" "$dir/manifest"
    for p in "$parts"/part*; do
        [ -f "$p" ] || continue
        cp "$p" "$dir/$(basename "$p").tmp" && mv "$dir/$(basename "$p").tmp" "$dir/$(basename "$p")"
        echo "join: kept $(basename "$p") ($(stat -c %s "$p") bytes)"
    done
    wheel=$(sed -n 's/^wheel=//p' "$dir/manifest")
    sum=$(sed -n 's/^sha256=//p' "$dir/manifest")
    n=$(sed -n 's/^parts=//p' "$dir/manifest")
    site=${FI_SITE:-/tmp/site}
    if [ -f "$dir/installed" ] && [ "$(cat "$dir/installed")" = "$sum" ]; then
        echo "join: $wheel already installed in $site"
        exit 0
    fi
    missing=()
    for i in $(seq 0 $((n - 1))); do
        f=$(printf 'part%02d' "$i")
        [ -f "$dir/$f" ] || missing+=("$f")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "join: still missing ${missing[*]} of $n; carry them in the next call" >&2
        exit 3
    fi
    cat $(for i in $(seq 0 $((n - 1))); do printf "$dir/part%02d " "$i"; done) > "$dir/$wheel"
    if [ "$(sha256sum "$dir/$wheel" | cut -d' ' -f1)" != "$sum" ]; then
        echo "join: sha256 of the joined $wheel does not match the manifest; parts dropped" >&2
        rm -f "$dir"/part* "$dir/$wheel"
        exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
        "$dir/$wheel"
    echo "$sum" > "$dir/installed"
    echo "join: installed $wheel into $site (sha256 ok); export PYTHONPATH=$site:\$PYTHONPATH" \
        "FLASHINFER_NO_DOWNLOAD=1"
    ;;
*)
    echo "usage: $0 split [DIR_WITH_THE_WHEEL] | join" >&2
    exit 2
    ;;
esac
