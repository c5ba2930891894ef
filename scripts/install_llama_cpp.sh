#!/usr/bin/env bash
# Install llama-cpp-python (the pinned version in constraints.txt) into a virtual environment,
# with draftwise's patches on its vendored llama.cpp (patches/llama.cpp, see docs/exactness.md).
#
# PyPI has no wheel for it: this builds it from its sdist, which vendors llama.cpp (a few
# minutes on 2 cores). The built wheel is kept in $DRAFTWISE_HOME/wheels (default
# ~/.cache/draftwise/wheels) under a tag of this CPU's instruction-set flags and of the patch
# set: llama.cpp is compiled for the CPU it is built on (-march=native), so a wheel built on an
# AVX-512 host would crash on an AVX2-only one, and is never reused there; a changed patch set
# builds a new wheel.
#
# With CUDA (nvcc on the path, or DRAFTWISE_CUDA=1; see scripts/llama_cpp_backend.sh) it is
# built with llama.cpp's CUDA backend for the GPU present, and its wheel is kept apart from the
# CPU one: the wheel's folder names the backend.
#
# AMX is left out (-mno-amx-*): ggml's AMX matrix kernels crash with SIGILL (a tile
# instruction run before its tile configuration) on this project's AMX machines; the
# AVX-512/AVX2 kernels run instead.
#
# usage: scripts/install_llama_cpp.sh VENV_BIN
set -euo pipefail
bin="${1:?usage: $0 VENV_BIN}"
here="$(cd "$(dirname "$0")/.." && pwd)"
version="$(sed -n 's/^llama-cpp-python==//p' "$here/constraints.txt" | head -n 1)"
[ -n "$version" ] || { echo "constraints.txt pins no llama-cpp-python version" >&2; exit 1; }
flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)"
patches="$here/patches/llama.cpp"
source "$here/scripts/llama_cpp_backend.sh"
tag="$( (printf '%s' "$flags"; cat "$patches"/*.patch) | sha256sum | cut -c1-12)"
wheels="${DRAFTWISE_HOME:-$HOME/.cache/draftwise}/wheels/llama-cpp-python-$version-$llama_cpp_backend-$tag"

if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $version for this CPU ($llama_cpp_backend), with draftwise's patches (once; a few minutes on 2 cores) ..." >&2
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "$bin/pip" download --quiet --no-deps --no-binary :all: --dest "$work" "llama-cpp-python==$version"
    tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    "$here/scripts/patch_llama_cpp.sh" "$work/llama_cpp_python-$version/vendor/llama.cpp"
    mkdir -p "$wheels"
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF $llama_cpp_cmake_args" CFLAGS="$no_amx" CXXFLAGS="$no_amx" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
        "$bin/pip" wheel --quiet --no-deps --no-cache-dir -w "$wheels" "$work/llama_cpp_python-$version"
fi
"$bin/pip" install --quiet --no-deps --force-reinstall "$wheels"/llama_cpp_python-"$version"-*.whl
"$bin/pip" install --quiet -c "$here/constraints.txt" numpy diskcache jinja2 typing-extensions
