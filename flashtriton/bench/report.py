"""The benchmark's report: the markdown table (with flashtriton's speed-ups), results.csv, the
plots, and one report of several runs' results.jsonl (--merge)."""

import csv
import json
import os


def _speedups(train, providers):
    """flashtriton's speed over each other provider, forward and backward, per shape group
    (head dim, causal): the range over the shapes both ran (markdown lines)."""
    others = [p for p in providers if p != "flashtriton"]
    ok = {(r["provider"], r["suite"], r["B"], r["H"], r["HKV"], r["D"], r["N"], r["causal"]): r
          for r in train if r.get("status") == "ok"}
    groups = {}
    for (prov, *shape), r in ok.items():
        mine = ok.get(("flashtriton", *shape))
        if prov == "flashtriton" or mine is None:
            continue
        key = (shape[0], shape[4], bool(shape[6]), prov)  # suite, D, causal, provider
        groups.setdefault(key, []).append((mine["fwd_tflops"] / r["fwd_tflops"],
                                           mine["bwd_tflops"] / r["bwd_tflops"]))
    if not groups or "flashtriton" not in providers:
        return []
    lines = ["", "flashtriton's speed-up over each provider (its TFLOP/s over theirs, forward / "
             "backward; the range over the sequence lengths of the table):", "",
             "| suite | D | causal | " + " | ".join(others) + " |",
             "|---|---|---|" + "---|" * len(others)]
    for suite, D, causal in sorted({k[:3] for k in groups}):
        cells = []
        for prov in others:
            ratios = groups.get((suite, D, causal, prov))
            if not ratios:
                cells.append("")
                continue
            f, b = zip(*ratios)
            span = lambda v: "-".join(dict.fromkeys(f"{x:.2f}" for x in (min(v), max(v))))
            cells.append(f"{span(f)}x / {span(b)}x")
        lines.append(f"| {suite} | {D} | {int(causal)} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows, providers, meta):
    head = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
            f"{meta['commit']}, {meta['date']}. TFLOP/s forward / backward (peak extra MiB)\n\n")
    lines = ["| suite | B | H/HKV | D | N | causal | " + " | ".join(providers) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(providers)]
    train = [r for r in rows if r.get("suite") in ("train", "gqa")]
    keys = sorted({(r["suite"], r["B"], r["H"], r["HKV"], r["D"], r["N"], r["causal"])
                   for r in train})
    for key in keys:
        cells = []
        for prov in providers:
            r = next((r for r in train if r["provider"] == prov and
                      (r["suite"], r["B"], r["H"], r["HKV"], r["D"], r["N"], r["causal"]) == key),
                     None)
            cells.append("" if r is None else
                         f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} ({r['peak_extra_MiB']:.0f})"
                         if r.get("status") == "ok" else r["status"][:30])
        s, B, H, HKV, D, N, c = key
        lines.append(f"| {s} | {B} | {H}/{HKV} | {D} | {N} | {int(c)} | " + " | ".join(cells) + " |")
    lines += _speedups(train, providers)
    dec = [r for r in rows if r.get("suite") == "decode"]
    if dec:
        dprov = sorted({r["provider"] for r in dec})
        lines += ["", "GB/s of K and V read per decoding step (% of the copy bandwidth): eager "
                  "calls' kernels / the same step replayed from a CUDA graph; GPU time after a "
                  "clean L2 flush (common.cold_ms).", "",
                  "| decode B | cache | " + " | ".join(f"{p} eager / graph" for p in dprov)
                  + " |", "|---|---|" + "---|" * len(dprov)]
        for B, N in sorted({(r["B"], r["N"]) for r in dec}):
            cells = []
            for prov in dprov:
                r = next((r for r in dec if (r["provider"], r["B"], r["N"]) == (prov, B, N)), None)
                cells.append("" if r is None else
                             f"{r['decode_GBps']:.0f} ({r['pct_of_copy']:.0f}%) / "
                             f"{r['graph_GBps']:.0f} ({r['graph_pct_of_copy']:.0f}%)"
                             if r.get("status") == "ok" else r["status"][:30])
            lines.append(f"| {B} | {N} | " + " | ".join(cells) + " |")
    cold = [r for r in rows if r.get("suite") == "coldstart"]
    if cold:
        lines += ["", "Seconds of a new shape family's first calls in a new process (causal, "
                  "bf16, batch 2, 2048 / D heads; tiles from the tuning tables, or autotuned "
                  "where said): the first forward + backward at 4K tokens, the first at another "
                  "length bucket, the slowest one-token step of a generation crossing 4K keys; "
                  "with an empty Triton cache / in a second process sharing it.", "",
                  "| D | autotune | first forward + backward | another bucket | slowest "
                  "generation step |", "|---|---|---|---|---|"]
        for r in cold:
            if r.get("status") != "ok":
                lines.append(f"| {r.get('D')} | {int(bool(r.get('autotune')))} | "
                             f"{r['status'][:40]} | | |")
                continue
            lines.append(
                f"| {r['D']} | {int(bool(r.get('autotune')))} | {r['empty_cache_s']:.1f} / "
                f"{r['second_process_s']:.1f} | {r['new_bucket_s']:.2f} / "
                f"{r['second_new_bucket_s']:.2f} | {r['generate_max_step_s']:.3f} / "
                f"{r['second_generate_max_step_s']:.3f} |")
    over = [r for r in rows if r.get("suite") == "overhead"]
    if over:
        lines += ["", "| host overhead per call (us) | " + " | ".join(r["provider"] for r in over)
                  + " |", "|---|" + "---|" * len(over),
                  "| B=1 H=4 N=128 D=64 bf16 | " + " | ".join(
                      f"{r['host_us']:.1f}" if "host_us" in r else r["status"][:30] for r in over)
                  + " |"]
    return head + "\n".join(lines) + "\n"


def write_csv(rows, path):
    fields = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def plot(rows, out_dir):
    """tflops.png (forward and backward TFLOP/s against seqlen, a panel per (suite, D, causal))
    and memory.png (peak extra memory against seqlen). Needs matplotlib; else nothing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [r for r in rows if r.get("status") == "ok" and r.get("suite") in ("train", "gqa")]
    panels = sorted({(r["suite"], r["D"], r["causal"]) for r in ok})
    if not panels:
        return []
    written = []
    for name, metrics in (("tflops.png", ("fwd_tflops", "bwd_tflops")),
                          ("memory.png", ("peak_extra_MiB",))):
        fig, axes = plt.subplots(len(metrics), len(panels), squeeze=False,
                                 figsize=(4 * len(panels), 3.2 * len(metrics)))
        for j, (suite, D, c) in enumerate(panels):
            for i, metric in enumerate(metrics):
                ax = axes[i][j]
                for prov in sorted({r["provider"] for r in ok}):
                    pts = sorted((r["N"], r[metric]) for r in ok if r["provider"] == prov and
                                 (r["suite"], r["D"], r["causal"]) == (suite, D, c))
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=prov)
                ax.set_xscale("log", base=2)
                if metric == "peak_extra_MiB":
                    ax.set_yscale("log")
                ax.set_title(f"{suite} D={D} {'causal' if c else 'full'}: {metric}", fontsize=9)
                ax.set_xlabel("seqlen")
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def report(rows, providers, meta, out_dir):
    """results.csv, results.md and the plots of ``rows`` in ``out_dir``; prints the table."""
    write_csv(rows, os.path.join(out_dir, "results.csv"))
    table = markdown(rows, providers, meta)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    plot(rows, out_dir)
    print(table)


def merge(paths, out_dir):
    """One report of the rows of several runs (their results.jsonl, e.g. one per GPU or per
    call): providers in the order they first appear; the header names every commit and date."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"no rows in {' '.join(paths)}")
    providers = list(dict.fromkeys(r["provider"] for r in rows if r.get("suite") != "decode"))
    meta = {k: ", ".join(dict.fromkeys(str(r.get(k)) for r in rows))
            for k in ("gpu", "torch", "triton", "commit", "date")}
    os.makedirs(out_dir, exist_ok=True)
    report(rows, providers, meta, out_dir)
