"""Compile every kernel variant of flashtriton for Hopper (sm_90) on any machine, GPU or not.

    python tools/compile_check.py            # TRITON_INTERPRET must be unset
    python tools/compile_check.py --hashes   # also each kernel's SASS and PTX hashes

Triton's wheel carries ptxas, so this catches compile errors that the interpreter cannot see
(types that only the compiler checks, shared memory over the limit) and reports the shared
memory of each kernel, whether its matrix products use Hopper's wgmma and whether its loads
are pipelined (asynchronous copies), with the alignment the launcher sees at runtime. CI runs it.
--hashes adds to each line the SHA-256 (12 hex digits) of the kernel's SASS (cuobjdump's
instruction stream) and of its PTX without line info (.loc / .file, the debug sections and
the $L__tmp labels that only they reference, which mark the inlined functions' scopes):
two trees whose hashes agree compile to the same code (a refactor's equivalence check).
"""
import hashlib
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    sys.exit("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashtriton.kernels.attn_bwd import _varlen_spans_kernel  # noqa: E402
from flashtriton.kernels.decode import (_attn_decode_kernel, _attn_merge_kernel,  # noqa: E402
                                        _cache_spans_kernel)
from flashtriton.kernels.block_mask import _block_mask_kernel  # noqa: E402
from sass_loop import (TARGET, compile_gluon_bwd, compile_gluon_fwd, compile_kernel, sass_of,  # noqa: E402
                       softmax_overlaps, source_for, spill_counts)  # tools/, beside this file

@triton.jit
def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

@triton.jit
def bias_mod(score, b, h, q_idx, kv_idx):
    return score - 0.1 * tl.abs(q_idx - kv_idx).to(tl.float32)

@triton.jit
def bias_grad(score, b, h, q_idx, kv_idx):
    return score * 0.0 + 1.0

bf = "*bf16"
variants = {
    "plain-causal": dict(HAS_UPPER=True),
    # the kernels as the launcher specialises them without GQA (GROUP 1 is a constant unless
    # the kernel opts out: see _attn_bwd_dkdv_kernel)
    "full-mha": dict(GROUP=1),
    "gqa-sq1": dict(SQ=1),  # one query token (a constant 1), GQA: GROUP stays a loop
    "sk1": dict(SK=1),
    "pointer-loads": dict(HAS_UPPER=True, USE_TMA=False),  # the forward without TMA
    "window": dict(HAS_LOWER=True, HAS_UPPER=True),
    "softcap-alibi": dict(HAS_SOFTCAP=True, HAS_ALIBI=1, HAS_UPPER=True),
    "alibi-one-sided": dict(HAS_ALIBI=2, HAS_UPPER=True),  # causal ALiBi (alibi_part)
    "varlen": dict(IS_VARLEN=True, HAS_UPPER=True),
    "varlen-seqused": dict(IS_VARLEN=True, HAS_UPPER=True, SEQUSED_K="*i32"),
    "varlen-spans": dict(IS_VARLEN=2, HAS_UPPER=True),  # the backward's bounded rows
    "mask-bool": dict(MASK_KIND=1),
    "dropout": dict(HAS_DROPOUT=True),
    "mods-blockmask": dict(SCORE_MOD=bias_mod, SCORE_GRAD=bias_grad, MASK_MOD=causal_mod,
                           HAS_BLOCK_MASK=True),
    "sinks-window": dict(HAS_SINK=True, HAS_LOWER=True, HAS_UPPER=True),  # gpt-oss's layers
    # paged varlen: 16-token pages by pointers (each chunk's pages before its tiles), 256 by TMA
    "paged-16": dict(IS_VARLEN=3, PAGE_SIZE=16, USE_TMA=False, HAS_UPPER=True,
                     SEQUSED_K="*i32", BLOCK_TABLE="*i32"),
    "paged-256-tma": dict(IS_VARLEN=3, PAGE_SIZE=256, HAS_UPPER=True, SEQUSED_K="*i32",
                          BLOCK_TABLE="*i32"),
    # mixed batches: the one-query sequences left to the split-KV kernel
    "paged-16-singles": dict(IS_VARLEN=4, PAGE_SIZE=16, USE_TMA=False, HAS_UPPER=True,
                             SEQUSED_K="*i32", BLOCK_TABLE="*i32"),
    "invariant": dict(INVARIANT=True, HAS_UPPER=True),  # batch_invariant's masked whole tiles
}
FORWARD_ONLY = ("HAS_SINK", "PAGE_SIZE", "INVARIANT")  # (the backward kernels take none)
fails = 0
HASHES = "--hashes" in sys.argv[1:]


def code_hashes(k):
    """' sass=... ptx=...': SHA-256 prefixes of k's SASS and of its PTX without line info."""
    ptx = k.asm["ptx"].split("\t.section\t.debug", 1)[0]
    ptx = re.sub(r"^(\s*\.(loc|file)\b.*|\$L__tmp\d+:)\n", "", ptx, flags=re.M)
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:12]  # noqa: E731
    return f" sass={digest(sass_of(k))} ptx={digest(ptx)}"


def check(name, build, judge):
    """Compile with build(), judge the kernel (-> ok, details), print one line, count a
    failure (a compile error is one); --hashes: with the kernel's code_hashes."""
    global fails
    try:
        k = build()
        ok, details = judge(k)
        if HASHES:
            details += code_hashes(k)
    except Exception as e:
        ok, details = False, f"{type(e).__name__}: {str(e)[:300]}"
    fails += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} {details}", flush=True)


def variant_judge(k):
    ptx = k.asm["ptx"]
    return ("wgmma" in ptx and ".local" not in ptx and "cp.async" in ptx,
            f"shared={k.metadata.shared} wgmma={'wgmma' in ptx} pipelined={'cp.async' in ptx} "
            f"local_memory={'.local' in ptx}")


for kname in ("fwd", "dkdv", "dq"):
    for vname, v in variants.items():
        if kname == "fwd" and (v.get("HAS_ALIBI") == 2 or v.get("IS_VARLEN") == 2):
            continue  # the backward's forms (one-sided ALiBi, bounded varlen rows)
        if kname != "fwd" and any(v.get(flag) for flag in FORWARD_ONLY):
            continue  # sinks (the LSE holds them), pages and batch_invariant: forward only
        bm, bn = (64, 128) if kname == "dkdv" else (128, 64)
        check(f"{kname:5s} {vname:15s}",
              lambda: compile_kernel(kname, 128, bm, bn, 8, 3, **v), variant_judge)
# every bf16 training tile the autotuner may try, at each head-dim class (causal variant):
# a tile that spills to local memory or overflows shared memory is a wasted candidate. Tiles
# whose products have fewer than 64 rows per warpgroup compile to mma.sync, not wgmma:
# reported, not failed (the autotuner decides whether they win).
from flashtriton import configs  # noqa: E402
def tile_judge(k):
    ptx = k.asm["ptx"]
    spills = "%d/%d" % spill_counts(sass_of(k))  # ptxas's: reported, not failed
    return (k.metadata.shared <= 227 * 1024 and ".local" not in ptx,
            f"shared={k.metadata.shared} local_memory={'.local' in ptx} "
            f"{'wgmma' if 'wgmma' in ptx else 'mma.sync'} spill_ld/st={spills}")


for kname in ("fwd", "dkdv", "dq"):
    for bd, cfgs in configs._GPU[kname].items():
        for bm, bn, warps, stages in cfgs:
            check(f"{kname:5s} D{bd} tile {bm}x{bn} warps={warps} stages={stages}",
                  lambda: compile_kernel(kname, bd, bm, bn, warps, stages, causal=True),
                  tile_judge)
# MLA's head dims (q and k 192 padded to 256, v 128): each kind's first tile of the 256 class
for kname in ("fwd", "dkdv", "dq"):
    bm, bn, warps, stages = configs._GPU[kname][256][0]
    check(f"{kname:5s} MLA 192/128 tile {bm}x{bn} warps={warps} stages={stages}",
          lambda: compile_kernel(kname, 256, bm, bn, warps, stages, causal=True, BLOCK_DV=128,
                                 EVEN_D=False), tile_judge)
# decode, merge, block mask
extra = [
    ("decode", _attn_decode_kernel, dict(BLOCK_D=128, EVEN_D=True, PAGED=True, PAGE_SIZE=16, SAME_LAYOUT=True, HAS_LOWER=False, HAS_UPPER=True,
        HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_BATCH_IDX=False, HAS_LEFTPAD=True, DOT_PREC="tf32", UPCAST=False,
        PDL=True, MERGE=True, BLOCK_R=4, BLOCK_C=16, BLOCK_M=16, BLOCK_N=64, TL=None, SINK=None,
        HAS_SINK=0),  # merges
     dict(Q=bf, K=bf, V=bf, CACHE_SEQLENS="*i32", BLOCK_TABLE="*i32", BATCH_IDX="*i32", LEFTPAD="*i32", ALIBI="*fp32",
          O_PART="*fp32", LSE_PART="*fp32", OUT=bf, LSE="*fp32", COUNTERS="*i32")),
    ("decode-one-split", _attn_decode_kernel, dict(BLOCK_D=128, EVEN_D=True, PAGED=False, PAGE_SIZE=1, SAME_LAYOUT=False,
        HAS_LOWER=False, HAS_UPPER=False, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_BATCH_IDX=False,
        HAS_LEFTPAD=False, DOT_PREC="tf32", UPCAST=False, PDL=False, MERGE=False, BLOCK_R=1,
        BLOCK_C=1, BLOCK_M=16, BLOCK_N=64, LSE_PART=None, TL=None, SINK=None,
        HAS_SINK=0),  # return_lse=False
     dict(Q=bf, K=bf, V=bf, CACHE_SEQLENS="*i32", BLOCK_TABLE="*i32", BATCH_IDX="*i32",
          LEFTPAD="*i32", ALIBI="*fp32", O_PART=bf)),  # writes out itself
    ("decode-no-lse", _attn_decode_kernel, dict(BLOCK_D=128, EVEN_D=True, PAGED=False, PAGE_SIZE=1,
        SAME_LAYOUT=True, HAS_LOWER=False, HAS_UPPER=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
        HAS_BATCH_IDX=False, HAS_LEFTPAD=False, DOT_PREC="tf32", UPCAST=False, PDL=True, MERGE=True,
        BLOCK_R=4, BLOCK_C=16, BLOCK_M=16, BLOCK_N=64, LSE=None, TL=None, SINK=None,
        HAS_SINK=0),  # no LSE, merging
     dict(Q=bf, K=bf, V=bf, CACHE_SEQLENS="*i32", BLOCK_TABLE="*i32", BATCH_IDX="*i32",
          LEFTPAD="*i32", ALIBI="*fp32", O_PART="*fp32", LSE_PART="*fp32", OUT=bf,
          COUNTERS="*i32")),
    ("merge", _attn_merge_kernel, dict(BLOCK_C=8, BLOCK_D=128, PDL=True, TL=None, SINK=None,
                                       HAS_SINK=False),
     dict(O_PART="*fp32", LSE_PART="*fp32", OUT=bf, LSE="*fp32")),
    ("merge-no-lse", _attn_merge_kernel, dict(BLOCK_C=8, BLOCK_D=128, PDL=True, LSE=None, TL=None,
                                              SINK=None, HAS_SINK=False),
     dict(O_PART="*fp32", LSE_PART="*fp32", OUT=bf)),
    # attention sinks: added by the one split that writes the output, or by the merges
    ("decode-one-split-sinks", _attn_decode_kernel, dict(BLOCK_D=128, EVEN_D=True, PAGED=False,
        PAGE_SIZE=1, SAME_LAYOUT=True, HAS_LOWER=False, HAS_UPPER=False, HAS_SOFTCAP=False,
        HAS_ALIBI=False, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, DOT_PREC="tf32", UPCAST=False,
        PDL=False, MERGE=False, BLOCK_R=1, BLOCK_C=1, BLOCK_M=16, BLOCK_N=64, TL=None, HAS_SINK=1),
     dict(Q=bf, K=bf, V=bf, CACHE_SEQLENS="*i32", BLOCK_TABLE="*i32", BATCH_IDX="*i32",
          LEFTPAD="*i32", ALIBI="*fp32", SINK="*bf16", O_PART=bf, LSE_PART="*fp32")),
    ("decode-merge-sinks", _attn_decode_kernel, dict(BLOCK_D=128, EVEN_D=True, PAGED=True,
        PAGE_SIZE=16, SAME_LAYOUT=True, HAS_LOWER=True, HAS_UPPER=True, HAS_SOFTCAP=False,
        HAS_ALIBI=False, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, DOT_PREC="tf32", UPCAST=False,
        PDL=True, MERGE=True, BLOCK_R=8, BLOCK_C=16, BLOCK_M=16, BLOCK_N=64, TL=None, HAS_SINK=2),
     dict(Q=bf, K=bf, V=bf, CACHE_SEQLENS="*i32", BLOCK_TABLE="*i32", BATCH_IDX="*i32",
          LEFTPAD="*i32", ALIBI="*fp32", SINK="*fp32", O_PART="*fp32", LSE_PART="*fp32",
          OUT=bf, LSE="*fp32", COUNTERS="*i32")),
    ("merge-sinks", _attn_merge_kernel, dict(BLOCK_C=8, BLOCK_D=128, PDL=True, TL=None,
                                             HAS_SINK=True),
     dict(O_PART="*fp32", LSE_PART="*fp32", OUT=bf, LSE="*fp32", SINK="*fp32")),
    # the timelines of tools/timeline.py decode (kernels.common.mark)
    ("merge-timeline", _attn_merge_kernel, dict(BLOCK_C=8, BLOCK_D=128, PDL=True, SINK=None,
                                                HAS_SINK=False),
     dict(O_PART="*fp32", LSE_PART="*fp32", OUT=bf, LSE="*fp32", TL="*i64")),
    ("blockmask", _block_mask_kernel, dict(MASK_MOD=causal_mod, BLOCK=128), dict(OUT="*i8")),
    ("varlen-spans", _varlen_spans_kernel, dict(BLOCK_B=256),
     dict(CU_Q="*i32", CU_K="*i32", SPANS="*i32")),
    ("cache-spans", _cache_spans_kernel, dict(HAS_BATCH_IDX=True, HAS_LEFTPAD=True, BLOCK_B=4),
     dict(CACHE_SEQLENS="*i32", BATCH_IDX="*i32", LEFTPAD="*i32", SPANS="*i32")),
]
for _, fn, consts, _ in extra:  # bf16 caches: no fp8 descales; batch-major queries
    if fn is _attn_decode_kernel:
        consts.update(FP8=False, K_DESCALE=None, V_DESCALE=None)
    if fn in (_attn_decode_kernel, _attn_merge_kernel):
        consts.update(CU_Q=None)
# paged varlen's one-query sequences (launch.decode.paged_singles): packed query rows
extra += [(f"{name}-packed", fn, {k: v for k, v in consts.items() if k != "CU_Q"},
           dict(ptrs, CU_Q="*i32")) for name, fn, consts, ptrs in extra[:1] + extra[3:4]]
# fp8 caches (float8_e4m3fn / e5m2 bytes, float32 descales) under a bf16 q: products in fp16
for fp8 in ("*fp8e4nv", "*fp8e5"):
    extra.append((f"decode-{fp8[1:]}", _attn_decode_kernel,
                  {k: v for k, v in extra[0][2].items() if k not in ("K_DESCALE", "V_DESCALE")}
                  | dict(FP8=True),
                  dict(extra[0][3], K=fp8, V=fp8, K_DESCALE="*fp32", V_DESCALE="*fp32")))
extra.append(("decode-timeline", _attn_decode_kernel,  # the merging split kernel, timed
              {k: v for k, v in extra[0][2].items() if k != "TL"}, dict(extra[0][3], TL="*i64")))
# every decoding tile the autotuner may try, at each head-dim class
# at one row block of 16 rows and at the most rows a program packs (configs.decode_rows)
fp8_at = [name for name, *_ in extra].index("decode-fp8e4nv")
for (bd, cfgs), at, tag in [(x, 0, "") for x in configs._GPU["decode"].items()] + [
        ((128, configs._FP8_DECODE), fp8_at, " fp8")]:
    for (_, bn, warps, stages), bm in [(c, m) for c in cfgs
                                       for m in (16, configs.decode_rows(1, 1 << 20, bd)[0])]:
        src = source_for(_attn_decode_kernel, dict(extra[at][2], BLOCK_D=bd, BLOCK_N=bn,
                                                   BLOCK_M=bm), extra[at][3])
        check(f"decode{tag} D{bd} BLOCK_M={bm} BLOCK_N={bn} warps={warps} stages={stages}",
              lambda: triton.compile(src, target=TARGET, options={"num_warps": warps,
                                                                  "num_stages": stages}),
              lambda k: (k.metadata.shared <= 227 * 1024 and ".local" not in k.asm["ptx"],
                         f"shared={k.metadata.shared}"))
for name, fn, consts, ptrs in extra:
    pdl = consts.get("PDL", False)  # launched as a programmatic dependent
    check(f"{name:9s}",
          lambda: triton.compile(source_for(fn, consts, ptrs), target=TARGET,
                                 options={"num_warps": 8, "num_stages": 3, "launch_pdl": pdl}),
          lambda k: (("griddepcontrol.wait" in k.asm["ptx"]) == pdl
                     and k.metadata.launch_pdl == pdl,
                     f"shared={k.metadata.shared} local_spill={'.local' in k.asm['ptx']} "
                     f"pdl={pdl}"))


def gluon_judge(dim):
    def judge(k):
        sass = sass_of(k)
        overlap = softmax_overlaps(sass, 64)
        return (k.metadata.shared <= 227 * 1024 and (overlap or dim != 128),
                f"shared={k.metadata.shared} softmax_overlaps_pv={overlap} "
                f"spill_ld/st={'%d/%d' % spill_counts(sass)}")
    return judge


# The Gluon forward (kernels/gluon/fwd.py): it exists for the softmax running while the P V
# product does, so at D=128 each consumer's loop must keep its exp2s (64 x 128 per 4-warp
# consumer: 64 a thread) between the two waits. At D=64 (192-row programs, routed from 2K
# tokens) and 256 (routed: 0.96-1.12x cuDNN on an H100 all the same, docs/perf.md) ptxas waits
# for P V before the exp2s: reported, not failed.
for dim in (64, 128, 256):
    for causal in (False, True):
        check(f"gluon-fwd D{dim} causal={causal}", lambda: compile_gluon_fwd(dim, causal=causal),
              gluon_judge(dim))
# At head dim 256 (key blocks of 64): its variants.
for name, flags in (("window", dict(lower=True, upper=True)),
                    ("softcap causal", dict(softcap=True, causal=True)),
                    ("alibi causal", dict(alibi=True, causal=True)),
                    ("sinks causal", dict(sinks=True, causal=True))):
    check(f"gluon-fwd D256 {name}", lambda: compile_gluon_fwd(256, **flags), gluon_judge(256))
# Its variants (launch.attention_forward_gluon): a two-sided window, softcap, ALiBi, a block
# mask's lists with a mask_mod.
for name, flags in (("window", dict(lower=True, upper=True)),
                    ("softcap causal", dict(softcap=True, causal=True)),
                    ("alibi causal", dict(alibi=True, causal=True)),
                    ("one-sided alibi causal", dict(alibi=2, causal=True)),
                    ("block mask", dict(mask_mod=causal_mod)),
                    ("sinks causal", dict(sinks=True, causal=True)),
                    ("sinks window", dict(sinks=True, lower=True, upper=True)),
                    # the programs' order over the grid (grid_order)
                    ("causal order groups of 8 heads", dict(causal=True, ORDER=8)),
                    ("window order whole windows first", dict(lower=True, upper=True,
                                                              ORDER=1))):
    check(f"gluon-fwd D128 {name}", lambda: compile_gluon_fwd(128, **flags), gluon_judge(128))

# The Gluon backward (kernels/gluon/bwd.py) at head dims 64 and 128: dQ added by TMA bulk
# reductions (two UTMAREDG a query block, from the producer), within the shared memory; plain,
# causal and its variants.
def gluon_bwd_judge(k):
    sass = sass_of(k)
    return (k.metadata.shared <= 227 * 1024 and "UTMAREDG" in sass,
            f"shared={k.metadata.shared} UTMAREDG={'UTMAREDG' in sass} "
            f"spill_ld/st={'%d/%d' % spill_counts(sass)}")


for name, flags in (("plain", {}), ("causal", dict(causal=True)),
                    ("window", dict(lower=True, upper=True)),
                    ("softcap causal", dict(softcap=True, causal=True)),
                    ("alibi", dict(alibi=True)),
                    ("one-sided alibi causal", dict(alibi=2, causal=True)),
                    ("block mask", dict(mask_mod=causal_mod)),
                    # EARLY_S the other way round (configs.gluon_bwd_options)
                    ("plain early-s", dict(EARLY_S=True)),
                    ("causal no early-s", dict(causal=True, EARLY_S=False)),
                    ("window early-s", dict(lower=True, upper=True, EARLY_S=True)),
                    # ONE_LOOP the other way round (configs.gluon_bwd_options)
                    ("window split walk", dict(lower=True, upper=True, ONE_LOOP=False)),
                    ("causal one loop", dict(causal=True, ONE_LOOP=True)),
                    # a group's steps that see none of its keys: no products but dQ's
                    ("window skip empty", dict(lower=True, upper=True, SKIP_EMPTY=True)),
                    ("causal one loop skip empty", dict(causal=True, ONE_LOOP=True,
                                                        SKIP_EMPTY=True)),
                    ("one-sided alibi causal skip empty", dict(alibi=2, causal=True,
                                                               SKIP_EMPTY=True)),
                    # the programs' order over the grid (gluon/common.grid_order)
                    ("causal order groups of 8 heads", dict(causal=True, ORDER=8)),
                    ("window order whole walks first", dict(lower=True, upper=True, ORDER=1)),
                    # the timing-only marks (tools/timeline.py backward)
                    ("window timeline", dict(lower=True, upper=True, timeline=True))):
    check(f"gluon-bwd D128 {name}", lambda: compile_gluon_bwd(128, **flags), gluon_bwd_judge)
# At head dim 64: plain, causal, a window.
for name, flags in (("plain", {}), ("causal", dict(causal=True)),
                    ("window", dict(lower=True, upper=True))):
    check(f"gluon-bwd D64 {name}", lambda: compile_gluon_bwd(64, **flags), gluon_bwd_judge)


# At head dim 256 (the head dim split between the consumers): dK and dV only, no dQ (neither
# reductions nor atomic adds: the Triton dQ kernel runs beside it).
def gluon_bwd_split_judge(k):
    sass = sass_of(k)
    return (k.metadata.shared <= 227 * 1024 and "UTMAREDG" not in sass and "REDG" not in sass,
            f"shared={k.metadata.shared} spill_ld/st={'%d/%d' % spill_counts(sass)}")


for name, flags in (("plain", {}), ("causal", dict(causal=True)),
                    ("window", dict(lower=True, upper=True)),
                    ("softcap causal", dict(softcap=True, causal=True)),
                    ("one-sided alibi causal", dict(alibi=2, causal=True)),
                    ("causal early-s", dict(causal=True, EARLY_S=True))):
    check(f"gluon-bwd D256 {name}", lambda: compile_gluon_bwd(256, **flags),
          gluon_bwd_split_judge)
# Head dims under the tiles' width (configs.GLUON_PADDED_HEAD_DIMS): 3-D descriptors whose
# columns past the head dim TMA fills with zeros, stores masked to the head dim.
for head_dim in (80, 96, 112, 192):
    width = 128 if head_dim < 128 else 256
    check(f"gluon-fwd D{head_dim} in {width} causal",
          lambda: compile_gluon_fwd(width, causal=True, head_dim=head_dim), gluon_judge(width))
    check(f"gluon-bwd D{head_dim} in {width} causal",
          lambda: compile_gluon_bwd(width, causal=True, head_dim=head_dim),
          gluon_bwd_judge if width == 128 else gluon_bwd_split_judge)
sys.exit(1 if fails else 0)
