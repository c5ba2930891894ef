#!/usr/bin/env bash
# Make the pack that scripts/cuda_check.py takes to a machine with a GPU and no network: what
# the check cannot build or fetch there in its few minutes, in one folder (55 MB for CUDA).
#
#   scripts/cuda_check_pack.sh build/cuda-pack          (llama.cpp for CUDA)
#   scripts/cuda_check_pack.sh build/cuda-pack-cpu cpu  (for the CPU: the rehearsal here)
#
# The pack holds, bin/ and vocab.gguf compressed in llama.tar.xz:
#   bin/      llama.cpp's shared libraries, llama-server and llama-quantize, built here from
#             the sdist pinned in constraints.txt (stock llama.cpp: draftwise's patches touch
#             only CPU kernels, and --exact is refused on CUDA), for the CPU family x86-64-v3
#             (AVX2), not this CPU's own (the other machine's may differ), and for CUDA
#             architecture DRAFTWISE_CUDA_ARCH (default 90: H100 and H200) with this
#             machine's nvcc. cuBLAS, which a toolkit without a GPU may lack, comes from PyPI
#             (nvidia-cublas of nvcc's release), for the build only: the GPU machine has its own.
#             CUDA's virtual memory management is left out (GGML_CUDA_NO_VMM), since linking
#             it needs the driver's libcuda, which only a machine with a GPU has.
#   python/   llama-cpp-python's Python package from the same sdist (it loads bin/'s library
#             through LLAMA_CPP_LIB_PATH), so nothing is compiled there.
#   wheels/   draftwise's server dependencies and all they need (numpy and torch aside: the GPU
#             machine's own), for Python 3.12, at the versions this .venv runs.
#   vocab.gguf  Qwen's tokenizer (llama.cpp's models/ggml-vocab-qwen2.gguf), for the random models.
#   pack.json   what the pack was built for and with (the check copies it into its JSON).
# Compiling ggml's CUDA kernels takes a long time on 2 cores (the build is kept under
# build/, and a second run only assembles the pack).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pack="${1:?usage: $0 PACK [cuda|cpu]}"
backend="${2:-cuda}"
case "$backend" in cuda | cpu) ;; *) echo "error: the backend is cuda or cpu, not '$backend'" >&2; exit 2 ;; esac
arch="${DRAFTWISE_CUDA_ARCH:-90}"
version="$(sed -n 's/^llama-cpp-python==\([^[:space:]]*\).*/\1/p' "$root/constraints.txt" | head -n 1)"
pip="$root/.venv/bin/pip"
[ -x "$pip" ] || { echo "error: no $pip: run make setup first" >&2; exit 2; }
work="$root/build/cuda-check-$backend"  # the build, kept: a second run only assembles the pack
mkdir -p "$(dirname "$pack")"
case "$(cd "$(dirname "$pack")" && pwd)/$(basename "$pack")/" in
    "$work"/*) echo "error: the pack cannot go into the build's own folder $work" >&2; exit 2 ;;
esac
source_dir="$work/llama_cpp_python-$version/vendor/llama.cpp"

if [ ! -d "$source_dir" ]; then
    mkdir -p "$work/sdist"
    "$pip" download --quiet --no-deps --no-binary :all: --dest "$work/sdist" "llama-cpp-python==$version"
    tar -xzf "$work/sdist/llama_cpp_python-$version.tar.gz" -C "$work"
fi

flags=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release)
if [ "$backend" = cuda ]; then
    cuda_home="${CUDA_HOME:-/usr/local/cuda}"
    [ -x "$cuda_home/bin/nvcc" ] || { echo "error: no nvcc in $cuda_home/bin (set CUDA_HOME)" >&2; exit 2; }
    toolkit="$cuda_home"
    release="$("$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"  # 13.0
    if [ ! -f "$cuda_home/include/cublas_v2.h" ]; then
        # A toolkit with cuBLAS added: a copy of this one, with PyPI's cuBLAS of nvcc's release.
        toolkit="$work/toolkit"
        if [ ! -f "$toolkit/include/cublas_v2.h" ]; then
            major="${release%%.*}"
            minor="${release#*.}"
            rm -rf "$toolkit" "$work/cublas"
            cp -a "$(readlink -f "$cuda_home")" "$toolkit"
            "$pip" download --quiet --no-deps --only-binary=:all: --dest "$work/cublas" \
                "nvidia-cublas>=$release,<$major.$((minor + 1))"
            (cd "$work/cublas" && python3 -m zipfile -e nvidia_cublas-*.whl .)
            lib="$(readlink -f "$toolkit/lib64")"
            cp "$work/cublas"/nvidia/cu*/include/* "$toolkit/include/"
            cp "$work/cublas"/nvidia/cu*/lib/* "$lib/"
            for so in "$lib"/libcublas*.so.*; do ln -sf "$(basename "$so")" "${so%%.so.*}.so"; done
        fi
    fi
    # The programs link against libggml-cuda, which needs cuBLAS: where the linker finds it.
    link="-Wl,-rpath-link,$(readlink -f "$toolkit/lib64")"
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch" -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF
        "-DCUDAToolkit_ROOT=$toolkit" "-DCMAKE_CUDA_COMPILER=$toolkit/bin/nvcc" "-DCMAKE_EXE_LINKER_FLAGS=$link")
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$source_dir" -B "$work/build" "${generator[@]}" "${flags[@]}" >&2
start=$(date +%s)
cmake --build "$work/build" --target llama llama-server llama-quantize -j "$(nproc)" >&2
built=$(( $(date +%s) - start ))
echo "built in $built s" >&2

rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/python" "$pack/wheels"
cp -a "$work/build/bin"/lib*.so* "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$pack/bin/"
strip --strip-unneeded "$pack/bin"/* 2>/dev/null || true
cp -a "$work/llama_cpp_python-$version/llama_cpp" "$pack/python/"
rm -rf "$pack/python/llama_cpp/lib"  # the libraries are bin/'s (LLAMA_CPP_LIB_PATH)
cp "$source_dir/models/ggml-vocab-qwen2.gguf" "$pack/vocab.gguf"
# draftwise's dependencies, with everything they need in turn, at the versions installed here,
# for CPython 3.12 on x86-64 Linux; but numpy and torch, whose builds the GPU machine has to
# match each other and its CUDA.
wanted="pydantic fastapi starlette uvicorn typer llguidance diskcache gguf"
mapfile -t pins < <("$root/.venv/bin/python" - $wanted <<'PY'
import re
import sys
from importlib.metadata import PackageNotFoundError, requires, version

found = {}
todo = list(sys.argv[1:])
while todo:
    name = todo.pop().lower().replace("_", "-")
    if name in found or name in ("numpy", "torch"):
        continue
    try:
        found[name] = version(name)
    except PackageNotFoundError:
        continue  # a need of another Python or platform (not installed here)
    todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in requires(name) or [] if "extra ==" not in r]
print("\n".join(f"{name}=={found[name]}" for name in sorted(found)))
PY
)
platforms=(--platform manylinux2014_x86_64)
for glibc in $(seq 17 39); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
"$pip" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    --dest "$pack/wheels" "${pins[@]}"
printf '{"backend": "%s", "cuda_arch": "%s", "nvcc": "%s", "llama_cpp_python": "%s", "build_seconds": %s, "cpu": "%s"}\n' \
    "$backend" "$([ "$backend" = cuda ] && echo "$arch")" "${release:-}" "$version" "$built" \
    "$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)" > "$pack/pack.json"
# What travels to the GPU machine is limited in size: the libraries and the tokenizer go
# compressed (the CUDA build's libggml-cuda alone is 60 MB, 39 MB compressed).
tar -C "$pack" -cf - bin vocab.gguf | xz -T0 -6 > "$pack/llama.tar.xz"
rm -rf "$pack/bin" "$pack/vocab.gguf"
du -sh "$pack" >&2
echo "$pack"
