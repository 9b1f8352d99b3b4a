"""Benchmark of the attention variants against FlexAttention on the same shapes.

    python -m flashtriton.bench.variants [--seqlen 8192] [--out bench_out]
        [--triton-variants] [--triton-bwd-variants] [--general-alibi]
        [--gluon-option NAME=0|1] [--ab NAME[=A,B]] [--rounds 3]

Variants (bf16, batch * seqlen = 16K tokens, 16 heads of 128): causal sliding window
of 1024, document masking (documents of 2048 tokens, through mask_mod + a block
mask), prefix-LM (a 1024-token bidirectional prefix, causal after it; mask_mod + block
mask), causal + ALiBi, causal + softcap 30. TFLOP/s count only the visible
(query, key) pairs: 4 * D * pairs forward, 2.5x that backward. Each provider's output and
gradients are checked against flashtriton.reference (reference_options: the same variant
as a float32 reference's options) before its speed is measured; the providers are
measured in turn, --rounds times (their order rotated a round), and each figure is the
median of its rounds.
--ab NAME[=A,B] measures flashtriton at two settings of Gluon kernel options (off and on,
or A and B; several joined by + change together), both in the same turns as FlexAttention:
an A/B that drift between rounds reaches alike.
"""

import json
import os

import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter needs it beside @triton.jit code)

from flashtriton import configs

from . import common
from .common import check, expected, failed, measure, meta as run_meta, tiles_mark, tiles_since

WINDOW = 1024
DOC = 2048
PREFIX = 1024


@triton.jit
def _document_mod(b, h, q_idx, kv_idx):
    return (q_idx // 2048) == (kv_idx // 2048)


@triton.jit
def _prefix_lm_mod(b, h, q_idx, kv_idx):
    return (kv_idx < 1024) | (q_idx >= kv_idx)


def _pairs(name, N):
    i = torch.arange(N, dtype=torch.float64)
    if name == "window":
        return float(torch.clamp(i + 1, max=WINDOW).sum())
    if name == "document":
        return float(N * DOC)
    if name == "prefix_lm":  # causal pairs plus the prefix's keys above the diagonal
        return float(N * (N + 1) / 2 + PREFIX * (PREFIX - 1) / 2)
    return float(N * (N + 1) / 2)


def _slopes(H, device):
    return torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=device)


def reference_options(name, H, N, device):
    """The variant as flashtriton.reference's options (common.expected's keywords)."""
    i = torch.arange(N, device=device)[:, None]
    j = torch.arange(N, device=device)[None, :]
    return {"window": dict(causal=True, window_size=(WINDOW - 1, 0)),
            "document": dict(attn_mask=(i // DOC) == (j // DOC)),
            "prefix_lm": dict(attn_mask=(j < PREFIX) | (i >= j)),
            "alibi": dict(causal=True, alibi_slopes=_slopes(H, device)),
            "softcap": dict(causal=True, softcap=30.0)}[name]


def reference(name, q, k, v, dout):
    """expected's out, dq, dk, dv of the variant for (B, H, N, D) tensors, in that layout."""
    opts = reference_options(name, q.shape[1], q.shape[2], q.device)
    t = [x.transpose(1, 2) for x in (q, k, v, dout)]
    return [x.transpose(1, 2) for x in expected(*t, **opts)]


def _ours(name, B, H, N, device):
    from flashtriton import flash_attention
    from flashtriton.block_mask import create_block_mask

    slopes = _slopes(H, device)
    mods = {"document": _document_mod, "prefix_lm": _prefix_lm_mod}
    bm = create_block_mask(mods[name], None, None, N, N, device) if name in mods else None
    opts = {"window": dict(causal=True, window_size=(WINDOW - 1, 0)),
            "document": dict(block_mask=bm),
            "prefix_lm": dict(block_mask=bm),
            "alibi": dict(causal=True, alibi_slopes=slopes),
            "softcap": dict(causal=True, softcap=30.0)}[name]

    def run(q, k, v, _causal):
        return flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               **opts).transpose(1, 2)
    return run


def _flex(name, B, H, N, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, 256)
    torch._functorch.config.donated_buffer = False
    slopes = _slopes(H, device)

    def causal(b, h, q, k):
        return q >= k

    def window(b, h, q, k):
        return (q >= k) & (q - k < WINDOW)

    def document(b, h, q, k):
        return (q // DOC) == (k // DOC)

    def prefix_lm(b, h, q, k):
        return (k < PREFIX) | (q >= k)

    def alibi(score, b, h, q, k):
        return score - slopes[h] * (q - k)

    def softcap(score, b, h, q, k):
        return 30.0 * torch.tanh(score / 30.0)

    mask_mod = {"window": window, "document": document, "prefix_lm": prefix_lm}.get(name, causal)
    score_mod = {"alibi": alibi, "softcap": softcap}.get(name)
    block_mask = create_block_mask(mask_mod, None, None, N, N, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, _causal):
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return run


def option_value(current, value):
    """A Gluon kernel option's new value (text or int) typed as its current one: integer
    options (CONSUMER_REGS) stay integers, booleans become booleans, and so do 0 and 1 for
    an option that is None (chosen by configs.gluon_fwd_options / gluon_bwd_options); its
    other values (ORDER 2) stay integers."""
    if isinstance(current, int) and not isinstance(current, bool):
        return int(value)
    value = int(value)
    return bool(value) if current is not None or value in (0, 1) else value


def option_tables(name: str):
    """The bare name of a Gluon kernel option and the option tables it names: fwd.NAME
    configs.GLUON_FWD_OPTIONS, bwd.NAME configs.GLUON_BWD_OPTIONS, NAME whichever has it
    (both where both do: CONSUMER_REGS, PRODUCER_REGS). ValueError where none does."""
    fwd, bwd = configs.GLUON_FWD_OPTIONS, configs.GLUON_BWD_OPTIONS
    kernel, _, bare = name.rpartition(".")
    kernels = {"": (fwd, bwd), "fwd": (fwd, ), "bwd": (bwd, )}.get(kernel, ())
    tables = [t for t in kernels if bare in t]
    if not tables:
        raise ValueError(f"no Gluon kernel option {name!r}")
    return bare, tables


def set_gluon_options(items) -> None:
    """Each [fwd.|bwd.]NAME=VALUE of items into the option tables it names (option_tables),
    typed by option_value."""
    for item in items:
        name, _, value = item.partition("=")
        bare, tables = option_tables(name)
        for table in tables:
            table[bare] = option_value(table[bare], value)


def ab_parts(ab: str):
    """An A/B's parts: [(NAME as given, its option tables, bare name, [A, B])] for each
    [fwd.|bwd.]NAME[=A,B] joined by + (A and B: 0 and 1 unless given). ValueError for an
    unknown name or a count of values other than two."""
    parts = []
    for part in ab.split("+"):
        name, _, values = part.partition("=")
        bare, tables = option_tables(name)
        vals = [int(x) for x in values.split(",")] if values else [0, 1]
        if len(vals) != 2:
            raise ValueError(f"{part!r}: NAME=A,B takes two values")
        parts.append((name, tables, bare, vals))
    return parts


def ab_side(ab: str, side: int) -> list:
    """An A/B's setting A (side 0) or B (1) as [fwd.|bwd.]NAME=V items (set_gluon_options)."""
    return [f"{name}={int(option_value(tables[0][bare], vals[side]))}"
            for name, tables, bare, vals in ab_parts(ab)]


def _with_options(items, fn, *args):
    """fn(*args) with the Gluon kernels' options set by items (set_gluon_options), restored
    after."""
    saved = [(t, dict(t)) for t in (configs.GLUON_FWD_OPTIONS, configs.GLUON_BWD_OPTIONS)]
    set_gluon_options(items)
    try:
        return fn(*args)
    finally:
        for table, old in saved:
            table.update(old)


def variant_line(name: str, ours: list, flex: dict) -> str:
    """A table line: each of flashtriton's rows (one, or an A/B's two), FlexAttention's, and
    each of ours' speed-ups over it (fwd / bwd); a row that failed shows its status."""
    def cell(r):
        return (f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}" if r["status"] == "ok"
                else r["status"])

    def up(o):
        if o["status"] != "ok" or flex["status"] != "ok":
            return ""
        return (f"{o['fwd_tflops'] / flex['fwd_tflops']:.2f} / "
                f"{o['bwd_tflops'] / flex['bwd_tflops']:.2f}")
    return "| " + " | ".join([name] + [cell(o) for o in ours] + [cell(flex)]
                             + [up(o) for o in ours]) + " |"


def parser():
    p = common.parser("flashtriton.bench.variants", __doc__)
    p.add_argument("--seqlen", type=int, default=8192, help="sequence length")
    p.add_argument("--tokens", type=int, default=16384,
                   help="batch x seqlen (the batch is this over --seqlen, at least 1)")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--variants", nargs="+",
                   default=["window", "document", "prefix_lm", "alibi", "softcap"],
                   help="which variants to measure (see above)")
    common.add_out(p, "variants.jsonl and variants.md")
    common.add_commit(p)
    p.add_argument("--rounds", type=int, default=3,
                   help="measure flashtriton and FlexAttention in turn this many times; the "
                        "median of the rounds is reported")
    p.add_argument("--triton-variants", action="store_true",
                   help="the variants' forwards on the Triton kernel (configs.GLUON_VARIANTS off)")
    p.add_argument("--triton-bwd-variants", action="store_true",
                   help="the variants' backwards on the Triton kernels (configs.GLUON_BWD_VARIANTS "
                        "off)")
    p.add_argument("--general-alibi", action="store_true",
                   help="causal ALiBi's general |i - j| form in the Gluon kernels "
                        "(configs.GLUON_ALIBI_ONE_SIDED off)")
    p.add_argument("--gluon-option", "--gluon-bwd-option", dest="gluon_option",
                   action="append", default=[], metavar="NAME=0|1",
                   help="set an option of configs.GLUON_FWD_OPTIONS and / or GLUON_BWD_OPTIONS, "
                        "whichever has it (e.g. EARLY_S=0, HEAVY_FIRST=0, fwd.CONSUMER_REGS=240; "
                        "fwd. / bwd. names one kernel's)")
    p.add_argument("--ab", metavar="NAME[=A,B]",
                   help="flashtriton with Gluon kernel options off and on (or at A and B; "
                        "several joined by + change together), measured in the same turns")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        set_gluon_options(args.gluon_option)
        sides = [ab_side(args.ab, side) for side in (0, 1)] if args.ab else [[]]
    except ValueError as e:
        p.error(str(e))
    configs.GLUON_VARIANTS = not args.triton_variants
    configs.GLUON_ALIBI_ONE_SIDED = not args.general_alibi
    configs.GLUON_BWD_VARIANTS = not args.triton_bwd_variants
    common.need_gpus(p.prog)
    os.makedirs(args.out, exist_ok=True)
    N, H, D = args.seqlen, args.heads, args.dim
    B = max(1, args.tokens // N)
    meta = run_meta(args.commit)
    ours = {" ".join(["flashtriton"] + items): items for items in sides}
    ups = " | ".join(" ".join(["speed-up"] + items + ["fwd / bwd"]) for items in sides)
    head = " | ".join(f"{o} fwd / bwd" for o in ours)
    rows, lines = [], [f"| variant | {head} | FlexAttention fwd / bwd | {ups} |",
                       "|---" * (2 + 2 * len(ours)) + "|"]
    with open(os.path.join(args.out, "variants.jsonl"), "w") as f:
        for name in args.variants:
            res = {}
            mark = tiles_mark()  # flashtriton tunes in its check call below
            fns = dict.fromkeys(ours, _ours(name, B, H, N, "cuda"))
            fns["flex"] = _flex(name, B, H, N, "cuda")
            items = dict(ours, flex=[])
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            ref = reference(name, q, k, v, dout)
            err = {prov: _with_options(items[prov], check, fn, q, k, v, dout, ref)
                   for prov, fn in fns.items()}
            del ref
            flop = 4 * B * H * D * _pairs(name, N)
            ok = {prov: not failed(err[prov]) for prov in fns}
            runs = {prov: [] for prov in fns}
            for r in range(args.rounds):  # the providers in turn: drift reaches all alike
                for prov in common.rotated(list(fns), r):
                    fn = fns[prov]
                    if ok[prov]:
                        runs[prov].append(_with_options(items[prov], measure, fn, q, k, v, None,
                                                        dout))
            for prov in fns:
                row = dict(meta, variant=name, provider=prov.split()[0], B=B, H=H, N=N, D=D,
                           rel_err=err[prov], options=items[prov])
                if not ok[prov]:
                    row["status"] = failed(err[prov])
                else:
                    row.update(common.median_run(runs[prov]), status="ok", rounds=args.rounds)
                    row.update(fwd_tflops=flop / row["fwd_ms"] * 1e-9,
                               bwd_tflops=2.5 * flop / row["bwd_ms"] * 1e-9)
                    if prov in ours:  # the tiles its kernels were tuned to
                        row["tiles"] = tiles_since(mark)
                res[prov] = row
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(name, prov, row.get("fwd_tflops"), row.get("bwd_tflops"), row["status"],
                      row.get("tiles", ""), flush=True)
            lines.append(variant_line(name, [res[o] for o in ours], res["flex"]))
    table = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
             f"{meta['commit']}, {meta['date']}; B={B} H={H} N={N} D={D} bf16, TFLOP/s of visible "
             f"pairs\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(args.out, "variants.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
