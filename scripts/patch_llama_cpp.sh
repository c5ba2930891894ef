#!/usr/bin/env bash
# Apply draftwise's patches (patches/llama.cpp/*.patch, in name order) to a llama.cpp source
# tree: the one vendored in the llama-cpp-python sdist. Each patch is tried first; one that
# does not apply stops the build with its name.
#
# usage: scripts/patch_llama_cpp.sh LLAMA_CPP_DIR
set -euo pipefail
tree="${1:?usage: $0 LLAMA_CPP_DIR}"
patches="$(cd "$(dirname "$0")/.." && pwd)/patches/llama.cpp"
for patch in "$patches"/*.patch; do
    if ! patch --dry-run --forward --batch --silent -p1 -d "$tree" <"$patch" >/dev/null 2>&1; then
        echo "error: $(basename "$patch") does not apply to $tree (another llama.cpp version? see docs/exactness.md)" >&2
        exit 1
    fi
    patch --forward --batch --silent -p1 -d "$tree" <"$patch"
done
