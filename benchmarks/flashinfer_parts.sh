#!/usr/bin/env bash
# FlashInfer on the GPU machine (issue 42). Its wheel (flashinfer-python 0.7.2.post1, the version
# vLLM 0.33 pins: 62 MB) plus the project's tree is over one device call's 64 MiB, so it travels
# in ~30 MiB parts over successive calls to one warm machine and is joined there.
#
#   here:       bash benchmarks/flashinfer_parts.sh split [--cute-dsl] [DIR_WITH_THE_WHEEL]
#     downloads the wheel (unless DIR holds it), tars it (with --cute-dsl: and the CuTe DSL's four
#     wheels, 97 MB more) into one bundle, splits that into .fi_parts/partNN (PART_SIZE, 30M) with
#     .fi_parts/manifest (the bundle's sha256, the number of parts), and fetches FlashInfer's one
#     small dependency the GPU image lacks into .whl (../shared/device/fetch-wheels.sh).
#   or, in one call: bash benchmarks/flashinfer_parts.sh pack [DIR_WITH_THE_WHEEL]
#     installs the wheel here, drops the CUDA sources of kernel families ATOM never calls, and
#     packs the rest as .fi_parts/site.tar.xz (~26 MB: xz's solid compression of the JIT
#     sources); on the GPU `bash benchmarks/flashinfer_parts.sh unpack` extracts it to /tmp/site.
#   on the GPU: bash benchmarks/flashinfer_parts.sh join
#     copies each carried part into $FI_PARTS_DIR (default /tmp/fi-parts, outside the repo copy:
#     it stays while the machine stays warm), and once all are there checks the sha256 and
#     installs the wheels into /tmp/site (pip --no-deps). Exit 0 once installed, 3 while parts are
#     still missing (it says which), 1 on a bad checksum. The calls, in order: benchmarks/README.md
#     ("FlashInfer on the device").
#
# Dependencies (Requires-Dist of 0.7.2.post1): on the GPU image already (KINDS.md, 2026-11-17):
# torch, numpy, click, cuda-bindings (cuda-python's payload), einops, ninja, nvidia-ml-py,
# packaging, requests, tabulate, tqdm, filelock. Missing and needed at run time: apache-tvm-ffi
# (jit/core.py imports it; 0.1.15.post2, the version xgrammar pins here, meets <0.2,>=0.1.11).
# Missing and left out: nvidia-cudnn-frontend, cuda-tile, nccl4py, nccl-extensions (cuDNN /
# cuTile / NCCL paths this benchmark does not take; `import flashinfer` succeeds without them,
# checked on the CPU here). nvidia-cutlass-dsl is optional (--cute-dsl): without it FlashInfer's
# norms fall back from their CuTe DSL kernels (the default, what vLLM's install runs) to its CUDA
# JIT ones (norm/__init__.py), and flashinfer_compare.py records which path ran.
set -euo pipefail
VERSION=0.7.2.post1
WHEEL=flashinfer_python-$VERSION-py3-none-any.whl
CUTE_DSL=(nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
          nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1)
mode=${1:-}
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
parts=.fi_parts

case $mode in
split)
    shift
    cute=0
    if [ "${1:-}" = --cute-dsl ]; then cute=1; shift; fi
    src=${1:-}
    rm -rf "$parts"
    mkdir -p "$parts/bundle"
    if [ -n "$src" ] && [ -f "$src/$WHEEL" ]; then
        cp "$src/$WHEEL" "$parts/bundle/"
    else
        python3 -m pip download -q --no-deps "flashinfer-python==$VERSION" -d "$parts/bundle"
    fi
    if [ $cute = 1 ]; then  # the CuTe DSL (vLLM installs it with FlashInfer: its norms use it)
        plat=()
        for n in 17 27 28; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${plat[@]}" -d "$parts/bundle" "${CUTE_DSL[@]}"
    fi
    (cd "$parts" && tar cf bundle.tar -C bundle . && rm -r bundle)
    sum=$(sha256sum "$parts/bundle.tar" | cut -d' ' -f1)
    (cd "$parts" && split -b "${PART_SIZE:-30M}" -d -a 2 bundle.tar part && rm bundle.tar)
    n=$(ls "$parts"/part* | wc -l)
    printf 'sha256=%s\nparts=%s\ncute_dsl=%s\n' "$sum" "$n" "$cute" > "$parts/manifest"
    ../shared/device/fetch-wheels.sh apache-tvm-ffi==0.1.15.post2 >/dev/null
    ls -l "$parts"
    echo "carry one part per call, with .fi_parts/manifest; .whl (9 MiB) with one of them"
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
    sum=$(sed -n 's/^sha256=//p' "$dir/manifest")
    n=$(sed -n 's/^parts=//p' "$dir/manifest")
    site=${FI_SITE:-/tmp/site}
    if [ -f "$dir/installed" ] && [ "$(cat "$dir/installed")" = "$sum" ]; then
        echo "join: FlashInfer already installed in $site"
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
    cat $(for i in $(seq 0 $((n - 1))); do printf "$dir/part%02d " "$i"; done) > "$dir/bundle.tar"
    if [ "$(sha256sum "$dir/bundle.tar" | cut -d' ' -f1)" != "$sum" ]; then
        echo "join: sha256 of the joined bundle does not match the manifest; parts dropped" >&2
        rm -f "$dir"/part* "$dir/bundle.tar"
        exit 1
    fi
    rm -rf "$dir/wheels" && mkdir -p "$dir/wheels" && tar xf "$dir/bundle.tar" -C "$dir/wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
        "$dir"/wheels/*.whl
    echo "$sum" > "$dir/installed"
    echo "join: installed $(ls "$dir/wheels" | tr '\n' ' ')into $site (sha256 ok); export" \
        "PYTHONPATH=$site:\$PYTHONPATH FLASHINFER_NO_DOWNLOAD=1"
    ;;
pack)
    # One call instead of two: the wheel installed here and packed as one xz tarball (solid
    # compression of its JIT sources: 62 MB of wheel -> ~26 MB), without the CUDA sources of
    # kernel families ATOM never asks FlashInfer for (DROP_SOURCES). Carry .fi_parts and .whl.
    shift
    src=${1:-}
    rm -rf "$parts" && mkdir -p "$parts"
    tmp=$(mktemp -d)
    if [ -n "$src" ] && [ -f "$src/$WHEEL" ]; then
        cp "$src/$WHEEL" "$tmp/"
    else
        python3 -m pip download -q --no-deps "flashinfer-python==$VERSION" -d "$tmp"
    fi
    python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp/$WHEEL"
    for d in ${DROP_SOURCES:-kda gdn cake_dsv4 blackwell_bf16_fp4 blackwell_msa \
            cake_sage_block_sparse_attention cake_vsa_sm90 cake_trtllm_mla_blackwell \
            cake_all_gather_matmul alphamoe_nvfp4_sm100.cu}; do
        rm -rf "$tmp/site/flashinfer/data/csrc/$d"
    done
    rm -rf "$tmp/site/bin" "$tmp/site/b12x"
    XZ_OPT=${XZ_OPT:--6 -T2} tar -cJf "$parts/site.tar.xz" -C "$tmp/site" .
    rm -rf "$tmp"
    sum=$(sha256sum "$parts/site.tar.xz" | cut -d' ' -f1)
    printf 'sha256=%s\nform=site\n' "$sum" > "$parts/manifest"
    ../shared/device/fetch-wheels.sh apache-tvm-ffi==0.1.15.post2 >/dev/null
    ls -l "$parts"
    echo "carry .fi_parts and .whl; on the GPU: bash benchmarks/flashinfer_parts.sh unpack"
    ;;
unpack)
    site=${FI_SITE:-/tmp/site}
    [ -f "$parts/site.tar.xz" ] || { echo "unpack: $parts/site.tar.xz was not carried" >&2; exit 1; }
    sum=$(sed -n 's/^sha256=//p' "$parts/manifest")
    if [ -f "$site/.fi-installed" ] && [ "$(cat "$site/.fi-installed")" = "$sum" ]; then
        echo "unpack: FlashInfer already in $site"
        exit 0
    fi
    if [ "$(sha256sum "$parts/site.tar.xz" | cut -d' ' -f1)" != "$sum" ]; then
        echo "unpack: sha256 of site.tar.xz does not match the manifest" >&2
        exit 1
    fi
    mkdir -p "$site" && tar -xJf "$parts/site.tar.xz" -C "$site"
    echo "$sum" > "$site/.fi-installed"
    echo "unpack: FlashInfer $VERSION in $site; export PYTHONPATH=$site:\$PYTHONPATH" \
        "FLASHINFER_NO_DOWNLOAD=1"
    ;;
*)
    echo "usage: $0 split [--cute-dsl] [DIR_WITH_THE_WHEEL] | join | pack [DIR] | unpack" >&2
    exit 2
    ;;
esac
