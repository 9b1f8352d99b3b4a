#!/usr/bin/env bash
# One call on the GPU machine: tests (with the pass count), long-sequence / memory /
# compile tests, the demo, the benchmark and the variants benchmark. Logs under $OUT (or ./device_out).
# Usage: [PARTS="tests gpu demo bench variants"] bash tools/device_check.sh [COMMIT] [bench args...]
# The whole set takes longer than one 10-minute device call: run PARTS=tests, then the rest.
# Other parts: ring (NCCL ring tests and flashtriton.bench.ring; 2+ GPUs), host (host-overhead
# profile and decode split sweep), sweep (tools/sweep_decode.py $SWEEP_ARGS: graph GB/s per split
# count), decode (the decode bench), gluon (the Gluon kernels: smoke call, tests/test_gluon.py,
# bench_gluon forward and backward), only (tests named by $ONLY), ab (the bench's flashtriton rows
# once more from an older tree, for A/B in one run: here `mkdir -p .ab/old && git archive OLD
# flashtriton | tar -x -C .ab/old`, with /.ab/ in .git/info/exclude; then carry .ab and set
# AB_TREE=.ab/old AB_NAME=OLD; a tree from before flashtriton/bench/ runs its own module names),
# abvariants (the same for bench.variants; VARIANTS="alibi window" picks variants for both
# runs), optab (a Gluon kernel options $OPTION, each off and on or NAME=A,B at two values:
# tests, A/Bs, variants), timeline (tools/timeline.py backward: where a Gluon backward
# program's time goes, and its steps'; $TIMELINE_ARGS), dtimeline (tools/timeline.py decode:
# the decoding step's kernels; $DTIMELINE_ARGS).
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PARTS=" ${PARTS:-tests gpu demo bench variants} "
commit=${1:-unknown}; shift || true
# A sweep that fits one call; pass bench arguments to choose another.
[ $# -gt 0 ] || set -- --dims 64 128 --seqlens 1024 4096 16384 --gqa-seqlens 8192 \
  --decode-batches 1 16 --decode-lens 8192 65536
has() { [[ $PARTS == *" $1 "* ]]; }
# Correctness runs and the benchmark take their tiles from the tuning tables (no autotuning:
# FLASHTRITON_AUTOTUNE unset); the benchmark checks each kernel against the reference before
# it reports its speed.
has tests && timeout ${T_TESTS:-540} python3 -m pytest tests -n 16 -q \
  -p no:cacheprovider --ignore=tests/test_gpu.py -rf --tb=line --durations=5 > "$OUT/tests.log" 2>&1
has gpu && timeout ${T_GPU:-120} python3 -m pytest tests/test_gpu.py -q \
  -p no:cacheprovider -rf --tb=line > "$OUT/gpu_tests.log" 2>&1
has demo && timeout ${T_DEMO:-150} python3 -m flashtriton.bench.demo > "$OUT/demo.log" 2>&1
has bench && timeout ${T_BENCH:-300} python3 -m flashtriton.bench --commit "$commit" \
  --out "$OUT/bench" "$@" > "$OUT/bench.log" 2>&1
# `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: the old tree
# runs from its own directory, and the log names the package file it imported.
has ab && (cd "${AB_TREE:?set AB_TREE}" && PYTHONPATH=$PWD python3 -c \
  "import flashtriton; print('imported', flashtriton.__file__)" && timeout ${T_AB:-300} \
  python3 -m flashtriton.bench --commit "${AB_NAME:-old}" --providers flashtriton \
  --out "$OUT/ab_old" "$@") > "$OUT/ab_old.log" 2>&1
has variants && timeout ${T_VARIANTS:-200} python3 -m flashtriton.bench.variants --commit "$commit" \
  --out "$OUT/bench" ${VARIANTS:+--variants $VARIANTS} > "$OUT/bench_variants.log" 2>&1
# The variants bench once more from the older tree of `ab` (AB_TREE), for an A/B in one run.
has abvariants && (cd "${AB_TREE:?set AB_TREE}" && PYTHONPATH=$PWD timeout ${T_VARIANTS:-200} \
  python3 -m $(test -d flashtriton/bench && echo flashtriton.bench.variants || echo flashtriton.bench_variants) \
  --commit "${AB_NAME:-old}" --out "$OUT/ab_old" \
  ${VARIANTS:+--variants $VARIANTS}) > "$OUT/ab_variants.log" 2>&1
has only && timeout ${T_ONLY:-120} python3 -m pytest $ONLY -q \
  -p no:cacheprovider -rf --tb=short > "$OUT/only.log" 2>&1
has ring && timeout ${T_RING_TESTS:-200} python3 -m pytest tests/test_ring.py \
  -k nccl -q -p no:cacheprovider -rf --tb=short > "$OUT/ring_tests.log" 2>&1
has ring && timeout ${T_RING_BENCH:-200} python3 -m flashtriton.bench.ring \
  --commit "$commit" --out "$OUT/bench" ${RING_ARGS:-} > "$OUT/bench_ring.log" 2>&1
has decode && timeout ${T_DECODE_BENCH:-180} python3 -m flashtriton.bench --commit "$commit" \
  --suites decode --decode-batches 1 8 64 --decode-lens ${DECODE_LENS:-1024 8192 65536 131072} \
  --out "$OUT/decode" \
  > "$OUT/decode_bench.log" 2>&1
has timeline && timeout ${T_TIMELINE:-120} python3 tools/timeline.py backward ${TIMELINE_ARGS:-} \
  2>&1 | grep -v Warn > "$OUT/timeline.log"
has dtimeline && timeout ${T_DTIMELINE:-120} python3 tools/timeline.py decode ${DTIMELINE_ARGS:-} \
  2>&1 | grep -v Warn > "$OUT/dtimeline.log"
has sweep && timeout ${T_SWEEP:-240} python3 tools/sweep_decode.py ${SWEEP_ARGS:-} \
  > "$OUT/sweep.log" 2>&1
# The Gluon kernels: one small call of each first (a barrier mistake hangs rather than fails:
# the rest is skipped then), their tests, the forward bench and (where the tree has the Gluon
# backward) the backward bench.
if has gluon; then
  if timeout ${T_GLUON_SMOKE:-200} python3 tools/bench_gluon.py --smoke > "$OUT/gluon_smoke.log" 2>&1; then
    timeout ${T_GLUON_TESTS:-420} python3 -m pytest tests/test_gluon.py \
      -n 8 -q -p no:cacheprovider -rf --tb=short > "$OUT/gluon_tests.log" 2>&1
    timeout ${T_GLUON_BENCH:-200} python3 tools/bench_gluon.py --dims 128 \
      --seqlens 1024 4096 16384 > "$OUT/gluon_bench.log" 2>&1
    timeout ${T_GLUON_BWD:-360} python3 tools/bench_gluon.py --backward --dims 128 \
      --seqlens 2048 8192 16384 > "$OUT/gluon_backward.log" 2>&1
  fi
fi
# Options of the Gluon kernels ($OPTION: one or more of [fwd.|bwd.]NAME or NAME=A,B, several
# joined by + changing together, e.g. "EARLY_S fwd.CONSUMER_REGS=232,240+fwd.PRODUCER_REGS=40,24";
# configs.GLUON_FWD_OPTIONS and / or GLUON_BWD_OPTIONS), each at A and B (off and on by default):
# tests/test_gluon.py once (its fixtures run every form; OPTAB_TESTS=0 skips it), then per
# option bench_gluon's round-robin A/B of each kernel that has it (a kernel that has none of
# its parts says so in its log) and bench.variants --ab (A, B and FlexAttention in turn,
# $VARIANT_ROUNDS rounds, 3; $VARIANTS, all five).
has optab && : "${OPTION:?set OPTION for optab}"
has optab && [ "${OPTAB_TESTS:-1}" != 0 ] && timeout ${T_OPTAB_TESTS:-240} \
  python3 -m pytest tests/test_gluon.py -n 16 -q -p no:cacheprovider -rf --tb=short \
  > "$OUT/optab_tests.log" 2>&1
optab_one() {  # $1: an OPTION entry; its logs are named by its first NAME
  local opt=${1%%=*}
  timeout ${T_OPTAB:-120} python3 tools/bench_gluon.py --ab "$1" --dims 128 \
    --seqlens 2048 8192 16384 --rounds 3 > "$OUT/optab_fwd_$opt.log" 2>&1
  timeout ${T_OPTAB:-120} python3 tools/bench_gluon.py --backward --ab "$1" --dims 128 \
    --seqlens 2048 8192 16384 --rounds 3 > "$OUT/optab_bwd_$opt.log" 2>&1
  timeout ${T_OPTAB_VARIANTS:-400} python3 -m flashtriton.bench.variants --commit "$commit" \
    --out "$OUT/optab_variants_$opt" --ab "$1" --rounds ${VARIANT_ROUNDS:-3} \
    ${VARIANTS:+--variants $VARIANTS} > "$OUT/optab_variants_$opt.log" 2>&1
}
optab_report() {
  local opt=${1%%=*}
  echo "== gluon $1"
  cat "$OUT/optab_fwd_$opt.log" "$OUT/optab_bwd_$opt.log" 2>/dev/null | grep -v "no option of"
  cat "$OUT/optab_variants_$opt/variants.md" 2>/dev/null || tail -5 "$OUT/optab_variants_$opt.log"
}
if has optab; then for o in $OPTION; do optab_one "$o"; done; fi
has host && timeout ${T_HOST:-90} python3 tools/profile_host.py > "$OUT/host.log" 2>&1
has host && timeout ${T_DECODE:-90} python3 tools/sweep_decode.py > "$OUT/decode_sweep.log" 2>&1
has only     && { echo "== only"; grep -E "^(FAILED|ERROR)" "$OUT/only.log" | cut -c1-300;
                  grep -E "passed|failed" "$OUT/only.log" | tail -1; }
has ring     && { echo "== ring"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/ring_tests.log" | tail -5;
                  cat "$OUT/bench/ring.md" 2>/dev/null || tail -15 "$OUT/bench_ring.log"; }
has host     && { echo "== host"; head -14 "$OUT/host.log"; cat "$OUT/decode_sweep.log"; }
has gluon    && { echo "== gluon"; cat "$OUT/gluon_smoke.log"; grep -E "^(FAILED|ERROR)" \
                  "$OUT/gluon_tests.log" | cut -c1-300; grep -E "passed|failed" "$OUT/gluon_tests.log" \
                  | tail -1; cat "$OUT/gluon_bench.log" "$OUT/gluon_backward.log" 2>/dev/null; }
has timeline && { echo "== backward timeline"; cat "$OUT/timeline.log"; }
has dtimeline && { echo "== decode timeline"; cat "$OUT/dtimeline.log"; }
has optab    && { echo "== gluon tests"; grep -E "^(FAILED|ERROR)" "$OUT/optab_tests.log" \
                  2>/dev/null | cut -c1-300 | head; grep -E "passed|failed" "$OUT/optab_tests.log" \
                  2>/dev/null | tail -1; for o in $OPTION; do optab_report "$o"; done; }
has sweep    && { echo "== decode splits (graph GB/s)"; cat "$OUT/sweep.log"; }
has decode   && { echo "== decode"; cat "$OUT/decode/results.md" 2>/dev/null || tail -5 "$OUT/decode_bench.log"; }
has tests    && { echo "== tests"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-300 | head -40;
                  grep -E "passed|failed" "$OUT/tests.log" | tail -1; }
has gpu      && { echo "== gpu tests"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | cut -c1-300;
                  grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -1; }
has demo     && { echo "== demo"; grep -E "PASS|FAIL" "$OUT/demo.log"; }
has bench    && { echo "== bench"; cat "$OUT/bench/results.md" 2>/dev/null || tail -5 "$OUT/bench.log"; }
has ab       && { echo "== ab: ${AB_NAME:-old}"; grep -m1 imported "$OUT/ab_old.log"; cat "$OUT/ab_old/results.md" 2>/dev/null || tail -5 "$OUT/ab_old.log"; }
has variants && { echo "== variants"; cat "$OUT/bench/variants.md" 2>/dev/null || tail -5 "$OUT/bench_variants.log"; }
has abvariants && { echo "== variants, ${AB_NAME:-old}"; cat "$OUT/ab_old/variants.md" 2>/dev/null || tail -5 "$OUT/ab_variants.log"; }
true
