"""Compile one training kernel for sm_90 offline and print the skeleton of its SASS: matrix
products (HGMMA), waits for them (WARPGROUP.DEPBAR), exp2 (MUFU.EX2), barriers and branches,
with instruction counts of the non-tensor float pipes. A tuning aid (docs/perf.md): it shows
whether a product overlaps the softmax before any GPU time is spent.

    python tools/sass_loop.py --kernel dq --dim 128 --block-m 128 --block-n 64 --warps 8 --stages 2
    python tools/sass_loop.py --kernel fwd --causal --set HAS_ALIBI=1   # a variant's constexprs
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    sys.exit("sass_loop: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashtriton.kernels.attn_bwd import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel  # noqa: E402
from flashtriton.kernels.attn_fwd import _attn_fwd_kernel  # noqa: E402

KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}
TARGET = GPUTarget("cuda", 90, 32)
POINTERS = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", DO="*bf16", DK="*bf16", DV="*bf16",
                DQ="*bf16", LSE="*fp32", DELTA="*fp32", ALIBI="*fp32", AMASK="*i1", CU_Q="*i32",
                CU_K="*i32", BMASK="*i32", SINK="*fp32")
FLOATS = ("qk_scale", "cap2", "sm_scale", "dropout_p")
# The kernels' stride tuples (the launchers pass each tensor's strides as one tuple): how many
# strides each holds.
STRIDE_TUPLES = dict(stride_q=3, stride_k=3, stride_v=3, stride_o=3, stride_do=3, stride_dq=3,
                     stride_dk=3, stride_dv=3, stride_lse=2, stride_alibi=2, stride_mask=4,
                     stride_bmask=3, stride_part=4, stride_lse_part=3, stride_out=3,
                     stride_kd=2, stride_vd=2)
# The plain variant of the training kernels; callers override what they test.
DEFAULTS = dict(BLOCK_D=128, EVEN_D=True, BLOCK_DV=128, EVEN_DV=True, HAS_LOWER=False,
                HAS_UPPER=False, HAS_SOFTCAP=False,
                HAS_ALIBI=0, MASK_KIND=0, HAS_DROPOUT=False, SCORE_MOD=None, SCORE_GRAD=None,
                MASK_MOD=None, HAS_BLOCK_MASK=False, SPARSE=128, IS_VARLEN=False, SEQUSED_K=None,
                DOT_PREC="tf32", UPCAST=False, USE_TMA=True, STATS_TMA=True, HAS_SINK=False,
                PAGE_SIZE=0, BLOCK_TABLE=None, INVARIANT=False, BLOCK_M=128,
                BLOCK_N=64)
SKELETON = re.compile(r"(HGMMA|WARPGROUP\.(?:ARRIVE|DEPBAR)|MUFU\.EX2|BAR\.SYNC|BRA|DEPBAR)")


def _aligned(fn, sig):
    """What Triton's launcher derives from typical arguments: 16-byte aligned pointers and
    strides divisible by 16 (each of a tuple's), as compile attributes of fn's arguments under
    signature sig."""
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if isinstance(sig[n], tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(sig[n]))})
        elif sig[n].startswith("*") or n.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def source_for(fn, consts, pointers):
    """An ASTSource of ``fn``: the constexprs of ``consts`` that it takes, the pointer types of
    ``pointers``, fp32 for the float arguments, i32 for the rest (each of a stride tuple's),
    and what Triton's launcher derives from typical arguments: 16-byte aligned pointers and
    strides divisible by 16 (without it the compiler pipelines no load and the shared memory
    would not be the runtime's)."""
    runtime = {p.name for p in fn.params if p.do_not_specialize}  # never constants at runtime
    consts = {k: v for k, v in consts.items() if k in fn.arg_names and k not in runtime}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in FLOATS else "i32")
           for n in fn.arg_names}
    sig.update({n: ("i32",) * STRIDE_TUPLES[n] for n in fn.arg_names if n in STRIDE_TUPLES})
    return ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                     attrs=_aligned(fn, sig))


def compile_kernel(kind, dim, block_m, block_n, warps, stages, causal=False, **overrides):
    """One training kernel (fwd, dkdv, dq) for sm_90: bf16, head dim ``dim`` (v's too, unless
    BLOCK_DV is overridden), a tile, and constexpr overrides of ``DEFAULTS`` (e.g.
    HAS_SOFTCAP=True)."""
    consts = dict(DEFAULTS, BLOCK_D=dim, BLOCK_DV=dim, BLOCK_M=block_m, BLOCK_N=block_n,
                  HAS_UPPER=causal)
    consts.update(overrides)
    pointers = dict(POINTERS)  # an override "*i32" makes that argument a pointer
    pointers.update({n: consts.pop(n) for n, t in list(consts.items())
                     if isinstance(t, str) and t.startswith("*")})
    return triton.compile(source_for(KERNELS[kind], consts, pointers), target=TARGET,
                          options={"num_warps": warps, "num_stages": stages})


def _gluon_desc(block, dtype, width, head_dim=None):
    """The type of a host TensorDescriptor over a 2-D view of ``width`` columns (1-D with a
    1-D block; only its dtype, block and layout matter); head_dim (a head dim under the
    kernel's width): the 3-D view (rows, heads, head_dim) in blocks (rows, 1, block width)
    that the launcher makes there (launch.gluon_attn._gluon_descriptor)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    el = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    view = torch.empty(256, width, dtype=dtype) if len(block) == 2 else torch.empty(256 * width,
                                                                                  dtype=dtype)
    if head_dim is not None:
        view = torch.empty(256, 16, head_dim, dtype=dtype)
        block = [block[0], 1, block[1]]
    return mangle_type(TensorDescriptor(view, list(view.shape), list(view.stride()), block,
                                        gl.NVMMASharedLayout.get_default_for(block, el)))


def _gluon_compile(fn, consts, types):
    """A Gluon kernel for sm_90: constexprs ``consts``, argument types ``types`` (i32 for the
    rest), and (as source_for) what the launcher derives from typical arguments: 16-byte
    aligned pointers and strides divisible by 16 (without it the stores of dK, dV and O are
    2 bytes each)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    source = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                                 for k, v in consts.items()},
                            attrs=_aligned(fn, sig))
    return triton.compile(source, target=TARGET, options={"num_warps": consts["num_warps"]})


def compile_gluon_fwd(dim=128, causal=False, stages=None, lower=False, upper=False,
                      softcap=False, alibi=False, mask_mod=None, sinks=False, head_dim=None,
                      **options):
    """The Gluon forward (kernels/gluon/fwd.py) for sm_90, bf16, its descriptors typed as the
    launcher makes them (launch._gluon_forward: GLUON_FWD_BLOCK_M and gluon_fwd_block_n blocks, the
    ring of configs.GLUON_FWD_STAGES unless stages); a variant by its flags (alibi 1 / True
    the general form, 2 one-sided; mask_mod: a block mask's lists, LISTED, with this
    @triton.jit mask_mod; sinks: HAS_SINK; head_dim: the tensors' head dim under dim, the
    tiles' width, as configs.gluon_head_dim gives it); options override
    configs.gluon_fwd_options's."""
    import torch

    from flashtriton import configs
    from flashtriton.kernels.gluon import fwd
    bm = configs.gluon_fwd_block_m(dim, mask_mod is not None)
    under = head_dim if head_dim is not None and head_dim < dim else None
    q_desc = _gluon_desc([configs.gluon_fwd_q_block(bm), dim], torch.bfloat16, 16 * dim, under)
    kv_desc = _gluon_desc([configs.gluon_fwd_block_n(dim, bm), dim], torch.bfloat16, 16 * dim,
                          under)
    consts = dict(IS_CAUSAL=causal, NUM_STAGES=stages or configs.GLUON_FWD_STAGES,
                  HAS_LOWER=lower, HAS_UPPER=upper, HAS_SOFTCAP=softcap, HAS_ALIBI=alibi,
                  LISTED=mask_mod is not None, MASK_MOD=mask_mod, HAS_SINK=sinks,
                  CONSUMERS=bm // 64, DIM=head_dim or dim,
                  **{**configs.gluon_fwd_options(lower, bm), **options})
    return _gluon_compile(fwd._attn_fwd_gluon_kernel, consts, dict(
        q_desc=q_desc, k_desc=kv_desc, v_desc=kv_desc, O="*bf16", LSE="*fp32", ALIBI="*fp32",
        BMASK="*i32", SINK="*fp32", qk_scale="fp32", cap2="fp32"))


def compile_gluon_bwd(dim=128, causal=False, dq_mode=2, lower=False, upper=False,
                      softcap=False, alibi=False, mask_mod=None, timeline=False, head_dim=None,
                      **options):
    """The Gluon backward (kernels/gluon/bwd.py) for sm_90, bf16, its descriptors typed as
    launch._gluon_backward makes them (query blocks of configs.GLUON_BWD_BLOCK_M rows, key
    blocks of gluon_bwd_block_n, dQ halves); causal is the upper bound (as launch._common
    gives it); alibi 1 / True the general form, 2 one-sided; timeline: with the timing-only
    marks (TL an int64 pointer); head_dim as compile_gluon_fwd's; options override
    configs.gluon_bwd_options's."""
    import torch

    from flashtriton import configs
    from flashtriton.kernels.gluon import bwd
    consts = dict(DQ_MODE=dq_mode, HAS_LOWER=lower, HAS_UPPER=upper or causal,
                  HAS_SOFTCAP=softcap, HAS_ALIBI=alibi, LISTED=mask_mod is not None,
                  MASK_MOD=mask_mod, DIM=head_dim or dim,
                  **{**configs.gluon_bwd_options(upper or causal, lower, bool(alibi), dim),
                     **options})
    bm, bn = configs.GLUON_BWD_BLOCK_M, configs.gluon_bwd_block_n(dim)
    under = head_dim if head_dim is not None and head_dim < dim else None
    q_desc = _gluon_desc([bm, dim], torch.bfloat16, 16 * dim, under)
    kv_desc = _gluon_desc([bn, dim], torch.bfloat16, 16 * dim, under)
    dq_desc = (None if configs.gluon_bwd_split(dim)  # (no dQ there)
               else _gluon_desc([bm, dim // 2], torch.float32, 16 * dim, under))
    stats_desc = _gluon_desc([bm], torch.float32, 16)  # the rows' LSE and delta
    types = dict(q_desc=q_desc, do_desc=q_desc, k_desc=kv_desc, v_desc=kv_desc,
                 dq_desc=dq_desc, lse_desc=stats_desc, delta_desc=stats_desc, DK="*bf16",
                 DV="*bf16", ALIBI="*fp32", BMASK="*i32", qk_scale="fp32", sm_scale="fp32",
                 cap2="fp32")
    if dq_desc is None:
        consts["dq_desc"] = types.pop("dq_desc")
    if timeline:
        types["TL"] = "*i64"
    else:
        consts["TL"] = None
    return _gluon_compile(bwd._attn_bwd_gluon_kernel, consts, types)


def softmax_overlaps(sass, exps):
    """Whether some loop waits for S (one wgmma group, P V, still outstanding), runs at
    least ``exps`` exp2s, then waits for P V: the softmax overlapping the product. Waiting
    for P V first (as Triton's compiler does, and ptxas at a branch between the two) leaves
    no exp2 between the waits."""
    marks = {"MUFU.EX2": "e", "WARPGROUP.DEPBAR.LE gsb0, 0x1": "1",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0": "0"}
    ins = re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*?)\s*;", sass)
    seq = "".join(next((c for k, c in marks.items() if i.startswith(k)), "") for i in ins)
    return re.search("1e{%d,}0" % exps, seq) is not None


def sass_of(kernel):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "cuobjdump")
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def spill_counts(sass):
    """ptxas's register spills: (local loads, local stores) in a kernel's SASS."""
    return len(re.findall(r"\bLDL\b", sass)), len(re.findall(r"\bSTL\b", sass))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", choices=sorted(KERNELS), default="fwd")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="NAME=INT",
                   help="a constexpr of DEFAULTS set to an integer (1/0 for the flags)")
    args = p.parse_args()
    overrides = {}
    for item in args.set:
        name, value = item.split("=")
        if name not in DEFAULTS:
            p.error(f"--set {name}: not one of {sorted(DEFAULTS)}")
        overrides[name] = bool(int(value)) if isinstance(DEFAULTS[name], bool) else int(value)
    kernel = compile_kernel(args.kernel, args.dim, args.block_m, args.block_n, args.warps,
                            args.stages, args.causal, **overrides)
    sass = sass_of(kernel)
    prev = None
    for line in sass.splitlines():
        m = SKELETON.search(line)
        if m and m.group(1) != prev:  # one line per run of the same instruction
            print(re.sub(r"\s+", " ", line.split(";")[0]).strip())
        if m:
            prev = m.group(1)
    # Loops: a branch back to a lower address; per iteration, its instructions by kind.
    code = [(int(m.group(1), 16), m.group(2)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for addr, text in code:
        b = re.search(r"BRA (?:`\(.*?\)\s*)?0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < addr:
            body = [t for a, t in code if int(b.group(1), 16) <= a <= addr]
            kinds = collections.Counter(t.split()[0].lstrip("@!P0123456789T ").split(".")[0]
                                        if not t.startswith("@") else t.split()[1].split(".")[0]
                                        for t in body)
            top = ", ".join(f"{k} {v}" for k, v in kinds.most_common(9))
            print(f"loop 0x{int(b.group(1), 16):x}-0x{addr:x}: {len(body)} instructions, "
                  f"spill loads/stores {kinds['LDL']}/{kinds['STL']} ({top})")
    counts = collections.Counter(re.findall(r"\s(FFMA|FMUL|FADD|FMNMX|MUFU\.EX2|HGMMA|FSEL)[ .]",
                                            sass))
    print("spill loads/stores (LDL/STL) in the whole kernel: %d/%d" % spill_counts(sass))
    print(f"shared={kernel.metadata.shared} " + " ".join(f"{k}={v}" for k, v in
                                                          sorted(counts.items())))


if __name__ == "__main__":
    main()
