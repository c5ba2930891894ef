#!/bin/sh
# Every configuration of this folder's README, one after the other, into results.jsonl
# (per-request lines into requests.jsonl). Run from the repository root.
set -e
out=benchmarks/load_engine_amd
: > "$out/results.jsonl"
: > "$out/requests.jsonl"
for config in "4 off fixed 0" "4 hybrid cost 5" "8 off fixed 0" "8 hybrid cost 5" "8 model fixed 1" "8 ngram fixed 3"; do
    # shellcheck disable=SC2086
    python "$out/engine_load.py" $config >> "$out/results.jsonl" 2>> "$out/requests.jsonl"
done
