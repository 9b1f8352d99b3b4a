#!/usr/bin/env bash
# One call on the GPU machine: tests (with the pass count), long-sequence / memory /
# compile tests, the demo, the benchmark and the variants benchmark. Logs under $OUT (or ./device_out).
# Usage: bash scripts/device_check.sh [COMMIT] [bench args...]
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
commit=${1:-unknown}; shift || true
# A sweep that fits one call; pass bench arguments to choose another.
[ $# -gt 0 ] || set -- --dims 64 128 --seqlens 1024 4096 16384 --gqa-seqlens 8192 \
  --decode-batches 1 16 --decode-lens 8192 65536
# Correctness runs use each kernel's default config (compiling every autotuning candidate
# for every dtype and head dim would take most of the run); the benchmark autotunes and
# checks the tuned kernels against SDPA before it reports their speed.
FLASHTRITON_AUTOTUNE=0 timeout ${T_TESTS:-300} python3 -m pytest tests -n 16 -q -p no:cacheprovider \
  --ignore=tests/test_gpu.py -rf --tb=line --durations=5 > "$OUT/tests.log" 2>&1
FLASHTRITON_AUTOTUNE=0 timeout ${T_GPU:-120} python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider \
  -rf --tb=line > "$OUT/gpu_tests.log" 2>&1
timeout ${T_DEMO:-60} python3 -m flashtriton.demo > "$OUT/demo.log" 2>&1
timeout ${T_BENCH:-300} python3 -m flashtriton.bench --commit "$commit" --out "$OUT/bench" "$@" \
  > "$OUT/bench.log" 2>&1
timeout ${T_VARIANTS:-200} python3 -m flashtriton.bench_variants --commit "$commit" --out "$OUT/bench" \
  > "$OUT/bench_variants.log" 2>&1
echo "== tests";     grep -E "passed|failed" "$OUT/tests.log" | tail -1
echo "== gpu tests"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1
echo "== demo";      grep -E "PASS|FAIL" "$OUT/demo.log"
echo "== bench";     cat "$OUT/bench/results.md" 2>/dev/null || tail -5 "$OUT/bench.log"
echo "== variants";  cat "$OUT/bench/variants.md" 2>/dev/null || tail -5 "$OUT/bench_variants.log"
