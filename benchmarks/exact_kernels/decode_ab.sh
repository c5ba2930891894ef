#!/usr/bin/env bash
# One-token decoding, stock llama.cpp against draftwise's patched build with its default
# switches (what every run without --exact gets), alternated ROUNDS times so that both builds
# see the same drift of the machine: llama-bench -t 2, into decode_ab.csv (the build and round
# first, then llama-bench's own CSV).
#
#   STOCK=... PATCHED=... benchmarks/exact_kernels/decode_ab.sh MODEL.gguf
set -euo pipefail
model="${1:?usage: $0 MODEL.gguf}"
out="$(dirname "$0")/decode_ab.csv"
: >"$out"
for round in $(seq "${ROUNDS:-4}"); do
    for config in stock patched; do
        bin="$STOCK"
        [ "$config" = patched ] && bin="$PATCHED"
        for test in "-p 0 -n 32 -r 10" "-p 0 -n 16 -d 1024 -r 3"; do
            # shellcheck disable=SC2086
            "$bin/llama-bench" -m "$model" -t 2 $test -o csv 2>/dev/null | tail -n +2 | sed "s/^/$config,$round,/" >>"$out"
        done
    done
done
