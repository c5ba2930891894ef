#!/usr/bin/env bash
# llama.cpp's own cost curves for docs/speed.md, measured on the idle machine right after the bench runs.
B=/tmp/lcp/build/bin
M=~/.cache/draftwise/models
C=~/.cache/draftwise/converted
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200 > /tmp/benchlogs/cpu.txt
$B/llama-bench -m $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 -p 1,2,3,4,5,6,8,10,12,16 -n 32 -r 3 -o md > /tmp/benchlogs/lb_target.md 2>/tmp/benchlogs/lb_target.err
$B/llama-bench -m $M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf -m $C/qwen2.5-coder-0.5b-instruct-q4_k_m-q4_0-261274b7ff.gguf -t 2 -p 1,4,8,16 -n 32 -r 3 -o md > /tmp/benchlogs/lb_draft.md 2>/tmp/benchlogs/lb_draft.err
$B/llama-bench -m $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 1 -p 1,4,8 -n 32 -r 3 -o md > /tmp/benchlogs/lb_target_t1.md 2>/tmp/benchlogs/lb_target_t1.err
touch /tmp/benchlogs/IDLE_OK
