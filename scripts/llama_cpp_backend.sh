# Which of llama.cpp's backends a build of it is for: the CPU, or CUDA for the GPU present.
# Sourced by scripts/install_llama_cpp.sh (llama-cpp-python, for draftwise's llamacpp backend)
# and scripts/build_llama_cpp.sh (llama.cpp's own programs), so that both build the same one.
#
#   DRAFTWISE_CUDA=1       build for CUDA (an error if nvcc is not on the path)
#   DRAFTWISE_CUDA=0       build for the CPU, even where nvcc is
#   unset                  CUDA where nvcc is on the path and nvidia-smi lists a GPU, else the CPU
#                          (nvcc alone is not enough: a CUDA build cannot even load on a machine
#                          without NVIDIA's driver, and some images ship nvcc with no GPU)
#   DRAFTWISE_CUDA_ARCH=N  the GPU architecture to compile for (90 for an H100 or H200); default:
#                          the first GPU nvidia-smi lists, else CMake's "native" (the GPUs present)
#
# One architecture only: compiling ggml's CUDA kernels for every architecture takes many times
# longer and gives a wheel that runs nowhere faster.
#
# After sourcing: $llama_cpp_backend is "cpu" or "cuda<arch>" (part of the cached wheel's name,
# so a CPU wheel and a CUDA wheel never stand in for each other) and $llama_cpp_cmake_args holds
# the CMake flags that choose it.

llama_cpp_cuda_arch() {
    if [ -n "${DRAFTWISE_CUDA_ARCH:-}" ]; then
        printf '%s' "$DRAFTWISE_CUDA_ARCH"
        return
    fi
    local cap
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .' || true)"
    if [[ "$cap" =~ ^[0-9]+$ ]]; then
        printf '%s' "$cap"
    else
        printf 'native'
    fi
}

llama_cpp_cmake_args=""
case "${DRAFTWISE_CUDA:-}" in
    1)
        if ! command -v nvcc >/dev/null; then
            echo "error: DRAFTWISE_CUDA=1 builds llama.cpp for CUDA, but nvcc is not on the path (install the CUDA toolkit)" >&2
            return 2 2>/dev/null || exit 2
        fi
        want_cuda=1 ;;
    0 | "")
        want_cuda=0
        if [ -z "${DRAFTWISE_CUDA:-}" ] && command -v nvcc >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
            want_cuda=1
        fi ;;
    *)
        echo "error: DRAFTWISE_CUDA is 1 (build for CUDA) or 0 (for the CPU), not '${DRAFTWISE_CUDA}'" >&2
        return 2 2>/dev/null || exit 2 ;;
esac
if [ "$want_cuda" = 1 ]; then
    arch="$(llama_cpp_cuda_arch)"
    llama_cpp_backend="cuda$arch"
    llama_cpp_cmake_args="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$arch"
else
    llama_cpp_backend="cpu"
fi
unset want_cuda arch
