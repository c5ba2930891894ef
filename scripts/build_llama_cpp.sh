#!/usr/bin/env bash
# Builds llama.cpp's own programs (llama-bench, llama-completion, llama-speculative-simple, llama-server)
# from the llama-cpp-python sdist pinned in constraints.txt, so that the bench's llamacpp-spec
# anchor runs the very llama.cpp that the llamacpp backend runs. Prints the folder of the
# programs (for `draftwise bench --llama-cpp-bin DIR`); a second run finds them and only prints.
#
#   PY=.venv/bin/python scripts/build_llama_cpp.sh    (or: make llama-cpp-bin)
#
# These are stock llama.cpp, as a user would run it, for the backend that the install script
# builds llama-cpp-python for (the CPU, or CUDA: scripts/llama_cpp_backend.sh); a CUDA build
# goes under a folder of its own. PATCHED=1 builds them with draftwise's patches
# (patches/llama.cpp) under a folder of their own, to measure what the patches cost:
#   PATCHED=1 PY=.venv/bin/python scripts/build_llama_cpp.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PY:-python3}"
version="$(sed -n 's/^llama-cpp-python==\([^[:space:]]*\).*/\1/p' "$root/constraints.txt" | head -n 1)"
if [ -z "$version" ]; then
    echo "error: constraints.txt pins no llama-cpp-python version" >&2
    exit 2
fi
source "$root/scripts/llama_cpp_backend.sh"
suffix="${PATCHED:+-patched}"
[ "$llama_cpp_backend" = cpu ] || suffix="$suffix-$llama_cpp_backend"  # the CPU build keeps its folder
work="$root/build/llama-cpp-$version$suffix"  # build/ is ignored by git: nothing here is committed
bin="$work/build/bin"
targets=(llama-bench llama-completion llama-speculative-simple llama-server)

built=1
for target in "${targets[@]}"; do
    [ -x "$bin/$target" ] || built=0
done
if [ "$built" = 1 ]; then
    echo "$bin"
    exit 0
fi

mkdir -p "$work/sdist"
"$py" -m pip download --quiet --no-deps --no-binary :all: --dest "$work/sdist" "llama-cpp-python==$version" >&2
tar -xzf "$work/sdist/llama_cpp_python-$version.tar.gz" -C "$work"
source_dir="$work/llama_cpp_python-$version/vendor/llama.cpp"
if [ -n "${PATCHED:-}" ]; then
    "$root/scripts/patch_llama_cpp.sh" "$source_dir"
fi

# ggml's AMX matmul kernels die with SIGILL (a tile instruction run before its tile
# configuration) on this project's AMX machines, and -DGGML_NATIVE=ON turns them on wherever
# the CPU flags list AMX: leave them out (AVX-512 and the rest stay native).
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"

generator=()
if command -v ninja >/dev/null; then
    generator=(-G Ninja)
fi
# shellcheck disable=SC2086  # the backend's flags are words
cmake -S "$source_dir" -B "$work/build" "${generator[@]}" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF $llama_cpp_cmake_args >&2
cmake --build "$work/build" --target "${targets[@]}" -j "$(nproc)" >&2
echo "$bin"
