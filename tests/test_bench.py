"""The benchmarks (flashtriton.bench): the registry's shapes and FLOP counts, the writers, the
reference check every provider passes before its speed is measured (run through Triton's
interpreter on the CPU), and the variants bench's options (no GPU needed)."""

import csv
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashtriton import bench
from flashtriton import configs
from flashtriton.bench import common, report, train
from flashtriton.bench.cli import main as bench_main
from conftest import DEVICE, ON_GPU

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _args(**kw):
    ns = dict(suites=["train", "gqa"], dims=[64, 128], seqlens=[1024, 4096], causal=[0, 1],
              gqa_seqlens=[2048], tokens=16384, dmodel=2048)
    ns.update(kw)
    return type("Args", (), ns)


def test_shapes_keep_tokens_and_dmodel():
    shapes = bench.shapes(_args())
    train = [s for s in shapes if s.suite == "train"]
    assert len(train) == 2 * 2 * 2
    assert all(s.B * s.N == 16384 and s.H * s.D == 2048 and s.H == s.HKV for s in train)
    (gqa,) = [s for s in shapes if s.suite == "gqa"]
    assert (gqa.B, gqa.H, gqa.HKV, gqa.D, gqa.causal) == (1, 64, 8, 128, True)


def test_flops():
    assert bench.flops_fwd(2, 3, 5, 7, 11, False) == 4 * 2 * 3 * 5 * 7 * 11
    assert bench.flops_fwd(2, 3, 5, 7, 11, True) == 2 * 2 * 3 * 5 * 7 * 11


def _rows():
    meta = dict(gpu="test-gpu", torch="t", triton="tr", commit="c", date="d")
    rows = []
    for prov, speed in (("flashtriton", 2.0), ("sdpa_flash", 1.0)):
        for N in (1024, 4096):
            rows.append(dict(meta, provider=prov, suite="train", B=16384 // N, H=16, HKV=16, N=N,
                             D=128, causal=True, status="ok", fwd_tflops=100 * speed * N / 1024,
                             bwd_tflops=80 * speed, peak_extra_MiB=N / 8))
    rows.append(dict(meta, provider="naive", suite="train", B=4, H=16, HKV=16, N=4096, D=128,
                     causal=True, status="out of memory"))
    rows.append(dict(meta, provider="flashtriton", suite="overhead", status="ok", host_us=12.5))
    return meta, rows


def test_markdown_csv_and_plots(tmp_path):
    meta, rows = _rows()
    md = report.markdown(rows, ["flashtriton", "sdpa_flash", "naive"], meta)
    assert "| train | 4 | 16/16 | 128 | 4096 | 1 | 800 / 160 (512) | 400 / 80 (512) | out of memory |" in md
    assert "12.5" in md and "test-gpu" in md
    # the speed-up table: flashtriton at twice sdpa_flash's speed; naive never ran
    assert "| suite | D | causal | sdpa_flash | naive |" in md
    assert "| train | 128 | 1 | 2.00x / 2.00x |  |" in md
    report.write_csv(rows, tmp_path / "r.csv")
    with open(tmp_path / "r.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and got[-1]["host_us"] == "12.5"
    written = report.plot(rows, str(tmp_path))
    if importlib.util.find_spec("matplotlib") is None:
        assert written == []
    else:
        assert sorted(p.split("/")[-1] for p in written) == ["memory.png", "tflops.png"]
        assert all((tmp_path / n).stat().st_size > 1000 for n in ("memory.png", "tflops.png"))


def test_speedup_ranges_over_the_shapes_both_ran():
    meta, rows = _rows()
    for r in rows:
        if r.get("provider") == "sdpa_flash" and r["N"] == 4096:
            r.update(fwd_tflops=r["fwd_tflops"] * 4, bwd_tflops=r["bwd_tflops"] * 0.5)
    md = report.markdown(rows, ["flashtriton", "sdpa_flash"], meta)
    assert "| train | 128 | 1 | 0.50-2.00x / 2.00-4.00x |" in md


def test_decode_bytes_and_table():
    assert bench.decode_bytes(2, 1024) == 2 * 2 * 1024 * 8 * 128 * 2
    meta, rows = _rows()
    rows.append(dict(meta, suite="decode", provider="flashtriton", B=1, N=8192, H=32, HKV=8,
                     D=128, causal=False, status="ok", decode_GBps=1300.0, pct_of_copy=30.6,
                     graph_GBps=3900.0, graph_pct_of_copy=91.7))
    md = report.markdown(rows, ["flashtriton"], meta)
    assert "| 1 | 8192 | 1300 (31%) / 3900 (92%) |" in md


def test_coldstart_line_in_table():
    meta, rows = _rows()
    rows.append(dict(meta, suite="coldstart", provider="flashtriton", status="ok", D=64,
                     autotune=False, empty_cache_s=4.26, second_process_s=1.04,
                     new_bucket_s=0.213, second_new_bucket_s=0.018, generate_max_step_s=0.5,
                     second_generate_max_step_s=0.0021))
    rows.append(dict(meta, suite="coldstart", provider="flashtriton", D=256, autotune=True,
                     status="error: RuntimeError: boom"))
    md = report.markdown(rows, ["flashtriton"], meta)
    assert "| 64 | 0 | 4.3 / 1.0 | 0.21 / 0.02 | 0.500 / 0.002 |" in md
    assert "| 256 | 1 | error: RuntimeError: boom | | |" in md


def test_variant_pair_counts(monkeypatch):
    from flashtriton.bench import variants as bv
    monkeypatch.setattr(bv, "WINDOW", 8)
    monkeypatch.setattr(bv, "DOC", 16)
    monkeypatch.setattr(bv, "PREFIX", 4)
    N = 64
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    masks = {"window": (i >= j) & (i - j < 8), "document": (i // 16) == (j // 16),
             "prefix_lm": (j < 4) | (i >= j), "alibi": i >= j, "softcap": i >= j}
    for name, mask in masks.items():
        assert bv._pairs(name, N) == int(mask.sum()), name


def test_tiles_since_names_the_tuned_configs(monkeypatch):
    """tiles_since: the tiles runtime.tuned_tiles lists after the mark, by kernel ("fwd",
    "dkdv", "dq", "decode"; other kernels left out; a kernel tuned twice: its last tile)."""
    from flashtriton import runtime
    tuned = [("_attn_fwd_kernel", ("old",), (128, 64, 8, 3))]
    monkeypatch.setattr(runtime, "tuned_tiles", lambda: list(tuned))
    mark = common.tiles_mark()
    assert mark == 1
    tuned += [("_attn_bwd_dkdv_kernel", ("key",), (64, 128, 8, 2)),
              ("_some_other_kernel", ("key",), (1, 2, 3, 4)),
              ("_attn_decode_kernel", ("a",), (16, 32, 4, 2)),
              ("_attn_decode_kernel", ("b",), (0, 64, 4, 3))]
    assert common.tiles_since(mark) == {"dkdv": "64x128/8w/2s", "decode": "0x64/4w/3s"}
    assert common.tiles_since(0)["fwd"] == "128x64/8w/3s"
    assert common.tiles_since(common.tiles_mark()) == {}


def test_registry_lists_every_provider_and_suite():
    """One registry: the CLI's choices are the registry's providers and suites."""
    assert set(bench.PROVIDERS) == {"flashtriton", "sdpa_cudnn", "flex", "sdpa_flash",
                                    "sdpa_efficient", "flash_attn", "naive"}
    assert set(bench.DECODE_PROVIDERS) == {"flashtriton", "flashtriton_paged16",
                                           "flashtriton_paged_varlen16",
                                           "flashtriton_batch_invariant", "flashtriton_fp8",
                                           "flashtriton_paged16_fp8", "sdpa"}
    assert list(bench.SUITES) == ["train", "gqa", "overhead", "coldstart", "decode"]
    with pytest.raises(SystemExit) as exc:
        bench_main(["--providers", "no_such"])
    assert exc.value.code == 2


def _bthd(B=2, N=40, H=4, HKV=2, D=16, dtype=torch.float64):
    q = torch.randn(B, N, H, D, dtype=dtype)
    k, v = (torch.randn(B, N, HKV, D, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def _direct(q, k, v, dout, **kw):
    """flashtriton.reference's out and gradients in float64, in one call."""
    from flashtriton.reference import attention_reference
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = attention_reference(*leaves, **kw).out
    return [out.detach()] + list(torch.autograd.grad(out, leaves, dout.double()))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False),
                                dict(causal=True, window_size=(7, 0), softcap=5.0),
                                dict(causal=True, alibi_slopes=True), dict(attn_mask=True)],
                         ids=["causal", "full", "window-softcap", "alibi", "mask"])
@pytest.mark.parametrize("budget", [1 << 40, 1000], ids=["whole", "blocks"])
def test_expected_matches_the_reference_in_blocks(monkeypatch, kw, budget):
    """common.expected splits long sequences per batch element, KV head and block of query
    rows (budget 1000: blocks of 6 rows); its out, dq, dk, dv equal one call of the
    reference, GQA, masks and ALiBi included."""
    monkeypatch.setattr(common, "_BUDGET", budget)
    q, k, v, dout = _bthd()
    if kw.get("alibi_slopes"):
        kw = dict(kw, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    if kw.get("attn_mask"):
        i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
        kw = dict(kw, attn_mask=(i // 16) == (j // 16))
    got = common.expected(q, k, v, dout, **dict(kw))
    want = _direct(q, k, v, dout, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=name)
    out = common.expected(q, k, v, **dict(kw))  # no dout: the output alone
    torch.testing.assert_close(out.double(), want[0], atol=2e-5, rtol=2e-5)


def test_check_reports_a_wrong_provider_and_no_speed(monkeypatch):
    """Each provider's row checks out, dq, dk, dv against the reference first (run_shape with
    timed=False: the checks alone). flashtriton (through the interpreter on the CPU) and
    naive pass; a provider that is wrong, or returns NaN, gets a FAILED row with no speed."""
    shape = bench.Shape("train", 1, 2, 1, 64, 16, True)
    naive = bench.PROVIDERS["naive"]
    monkeypatch.setitem(bench.PROVIDERS, "wrong", lambda q, k, v, c: naive(q, k, v, not c))
    monkeypatch.setitem(bench.PROVIDERS, "nan", lambda q, k, v, c: naive(q, k, v, c) * float("nan"))
    rows = train.run_shape(shape, ["flashtriton", "naive", "wrong", "nan"], torch.float32, {},
                           device=DEVICE, timed=False)
    status = {r["provider"]: r["status"] for r in rows}
    assert status["flashtriton"] == status["naive"] == "checked", rows
    assert rows[0]["rel_err"] < 1e-4 and rows[1]["rel_err"] < 1e-4
    for prov in ("wrong", "nan"):
        assert status[prov].startswith("FAILED check") and "speed not reported" in status[prov]
        row = next(r for r in rows if r["provider"] == prov)
        assert not any(k.endswith("_ms") or k.endswith("_tflops") for k in row)


def test_decode_check_against_the_reference(monkeypatch):
    """The decode suite's providers, checked against the reference before timing: flashtriton
    over a contiguous cache and over shuffled pages, and SDPA, all match it (CPU: the
    interpreter); the paged inputs hold the same keys as the contiguous cache."""
    from flashtriton.bench import decode
    torch.manual_seed(0)
    x = decode.decode_inputs(2, 64, H=4, HKV=2, D=16, page=16, device=DEVICE, fp8=True)
    pages = x.k_pages[x.table.long()].reshape(2, 64, 2, 16)
    assert torch.equal(pages, x.k)
    assert torch.equal(x.fp8.k_pages[x.table.long()].reshape(2, 64, 2, 16).view(torch.uint8),
                       x.fp8.k.view(torch.uint8))
    # the fp8 cache stands for the same keys, to fp8's rounding
    assert decode.dequantized(x.fp8)[0].sub(x.k.float()).abs().max() <= x.k.abs().max() / 8
    checked = decode.check_decode(list(bench.DECODE_PROVIDERS), x)
    assert set(checked) == set(bench.DECODE_PROVIDERS)
    for prov, (fn, err) in checked.items():
        assert err < 1e-2, (prov, err)
    make, output = bench.DECODE_PROVIDERS["sdpa"]
    monkeypatch.setitem(bench.DECODE_PROVIDERS, "wrong",  # another cache's values
                        (lambda x: make(x._replace(v=x.v.flip(1))), output))
    fn, err = decode.check_decode(["wrong"], x)["wrong"]
    assert err > 1e-1


def test_merge_joins_runs_into_one_report(tmp_path):
    meta, rows = _rows()
    half = len(rows) // 2
    paths = []
    for i, part in enumerate((rows[:half], rows[half:])):
        path = tmp_path / f"run{i}.jsonl"
        with open(path, "w") as f:
            for r in part:
                f.write(json.dumps(dict(r, commit=f"c{i}")) + "\n")
        paths.append(str(path))
    bench_main(["--merge", *paths, "--out", str(tmp_path / "all")])
    md = (tmp_path / "all" / "results.md").read_text()
    assert "commit c0, c1" in md
    assert "| train | 4 | 16/16 | 128 | 4096 | 1 | 800 / 160 (512) | 400 / 80 (512) | out of memory |" in md
    with open(tmp_path / "all" / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no rows"):
        bench_main(["--merge", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "x")])


def test_variants_bench_sets_gluon_options(monkeypatch):
    """bench.variants --gluon-option NAME=VALUE sets the option in whichever Gluon kernel's
    OPTIONS has it (HEAVY_FIRST: the forward's, EARLY_S: the backward's; booleans stay
    booleans, integers such as CONSUMER_REGS integers; fwd.NAME the forward's only) before it
    needs the GPU, and rejects a name neither has."""
    from flashtriton.bench import variants as bv
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "HEAVY_FIRST", True)
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "EARLY_S", None)
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "CONSUMER_REGS", 240)
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "PRODUCER_REGS", 40)
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "PRODUCER_REGS", 24)
    for name in ("GLUON_VARIANTS", "GLUON_ALIBI_ONE_SIDED", "GLUON_BWD_VARIANTS"):
        monkeypatch.setattr(configs, name, getattr(configs, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bv.main(["--gluon-option", "HEAVY_FIRST=0", "--gluon-option", "EARLY_S=0",
                 "--gluon-option", "CONSUMER_REGS=232", "--gluon-option", "fwd.PRODUCER_REGS=32"])
    regs = configs.GLUON_BWD_OPTIONS["CONSUMER_REGS"]
    assert regs == 232 and type(regs) is int
    assert configs.GLUON_FWD_OPTIONS["PRODUCER_REGS"] == 32 and configs.GLUON_BWD_OPTIONS["PRODUCER_REGS"] == 24
    assert configs.GLUON_FWD_OPTIONS["HEAVY_FIRST"] is False and "HEAVY_FIRST" not in configs.GLUON_BWD_OPTIONS
    assert configs.GLUON_BWD_OPTIONS["EARLY_S"] is False and "EARLY_S" not in configs.GLUON_FWD_OPTIONS
    with pytest.raises(SystemExit) as exc:
        bv.main(["--gluon-option", "NO_SUCH=1"])
    assert exc.value.code == 2


def test_train_rows_are_medians_of_rotated_rounds(monkeypatch):
    """The train suite checks every provider first, then measures those that passed in
    rounds with their order rotated each round; each figure is the median of its rounds, a
    provider that failed its check is never timed."""
    shape = bench.Shape("train", 1, 2, 1, 64, 16, False)
    naive = bench.PROVIDERS["naive"]
    other = lambda q, k, v, c: naive(q, k, v, c)  # noqa: E731
    monkeypatch.setitem(bench.PROVIDERS, "other", other)
    monkeypatch.setitem(bench.PROVIDERS, "wrong", lambda q, k, v, c: naive(q, k, v, not c))
    order, ms = [], {"naive": iter([3.0, 1.0, 2.0]), "other": iter([5.0, 6.0, 4.0])}

    def fake_measure(fn, q, k, v, causal, dout=None):
        prov = "naive" if fn is naive else "other"
        order.append(prov)
        t = next(ms[prov])
        return dict(fwd_ms=t, bwd_ms=2 * t, fwdbwd_ms=3 * t, peak_extra_MiB=1.0)

    monkeypatch.setattr(train, "measure", fake_measure)
    rows = train.run_shape(shape, ["naive", "other", "wrong"], torch.float32, {}, device=DEVICE,
                           rounds=3)
    assert order == ["naive", "other", "other", "naive", "naive", "other"]
    row = {r["provider"]: r for r in rows}
    assert row["naive"]["fwd_ms"] == 2.0 and row["naive"]["fwd_ms_rounds"] == [3.0, 1.0, 2.0]
    assert row["other"]["bwd_ms"] == 10.0 and row["other"]["rounds"] == 3
    assert row["wrong"]["status"].startswith("FAILED check") and "fwd_ms" not in row["wrong"]


def test_variants_bench_reports_the_median_of_its_rounds():
    """bench.variants measures each provider --rounds times in turn: every figure is the
    median over the rounds, and each round's milliseconds are kept beside it."""
    from flashtriton.bench.common import median_run
    runs = [dict(fwd_ms=3.0, bwd_ms=9.0, peak_extra_MiB=5.0),
            dict(fwd_ms=1.0, bwd_ms=7.0, peak_extra_MiB=5.0),
            dict(fwd_ms=2.0, bwd_ms=20.0, peak_extra_MiB=6.0)]
    row = median_run(runs)
    assert (row["fwd_ms"], row["bwd_ms"], row["peak_extra_MiB"]) == (2.0, 9.0, 5.0)
    assert row["bwd_ms_rounds"] == [9.0, 7.0, 20.0] and "peak_extra_MiB_rounds" not in row
    assert median_run(runs[:2])["fwd_ms"] == 2.0
    from flashtriton.bench import variants
    with pytest.raises(SystemExit) as exc:  # argparse's error, before it looks for a GPU
        variants.main(["--rounds", "0"])
    assert exc.value.code == 2


def test_variants_bench_ab(monkeypatch):
    """bench.variants --ab NAME[=A,B]: each side's NAME=V items (integers stay integers, 0 and
    1 unless given, + joins parts), options set only while a measurement runs and restored
    after (an exception included), a table line with both sides and their speed-ups over
    FlexAttention (a failed row shows its status), and argparse's error for a bad --ab."""
    from flashtriton.bench import variants as bv
    monkeypatch.setitem(configs.GLUON_BWD_OPTIONS, "EARLY_S", None)
    monkeypatch.setitem(configs.GLUON_FWD_OPTIONS, "CONSUMER_REGS", 240)
    ab = "EARLY_S+fwd.CONSUMER_REGS=232,240"
    assert [bv.ab_side(ab, s) for s in (0, 1)] == [["EARLY_S=0", "fwd.CONSUMER_REGS=232"],
                                                   ["EARLY_S=1", "fwd.CONSUMER_REGS=240"]]
    seen = bv._with_options(bv.ab_side(ab, 0), lambda x: (x, configs.GLUON_BWD_OPTIONS["EARLY_S"],
                                                          configs.GLUON_FWD_OPTIONS["CONSUMER_REGS"]), 7)
    assert seen == (7, False, 232)
    with pytest.raises(ZeroDivisionError):
        bv._with_options(["EARLY_S=1"], lambda: 1 / 0)
    assert configs.GLUON_BWD_OPTIONS["EARLY_S"] is None and configs.GLUON_FWD_OPTIONS["CONSUMER_REGS"] == 240
    for bad in ("NO_SUCH", "EARLY_S=0,1,1"):
        with pytest.raises(ValueError):
            bv.ab_parts(bad)
        with pytest.raises(SystemExit) as exc:
            bv.main(["--ab", bad])
        assert exc.value.code == 2
    row = dict(status="ok", fwd_tflops=400.0, bwd_tflops=300.0)
    flex = dict(status="ok", fwd_tflops=320.0, bwd_tflops=250.0)
    assert bv.variant_line("window", [row, dict(row, bwd_tflops=330.0)], flex) == \
        "| window | 400 / 300 | 400 / 330 | 320 / 250 | 1.25 / 1.20 | 1.25 / 1.32 |"
    assert bv.variant_line("alibi", [dict(status="FAILED check")], flex) == \
        "| alibi | FAILED check | 320 / 250 |  |"


def test_variants_bench_rotates_its_order():
    """bench.variants' rounds rotate the providers' order: over as many rounds as providers,
    each runs once in every place."""
    from flashtriton.bench.common import rotated
    provs = ["flashtriton A", "flashtriton B", "flex"]
    orders = [rotated(provs, r) for r in range(6)]
    assert orders[0] == provs and orders[1] == ["flashtriton B", "flex", "flashtriton A"]
    assert orders[3] == provs
    for place in range(3):
        assert sorted(o[place] for o in orders[:3]) == sorted(provs)


def test_sinks_bench_checks_before_timing(monkeypatch):
    """bench.sinks' check passes the kernels with sinks and fails a call that drops them."""
    import flashtriton
    from flashtriton.bench import sinks as bench_sinks
    from flashtriton.bench.common import TOLERANCE
    from conftest import DEVICE
    q = torch.randn(1, 24, 4, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 24, 2, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    sinks = (torch.randn(4, device=DEVICE) * 2).requires_grad_()
    assert bench_sinks._check(q, k, v, sinks, 7) < 1e-3
    real = flashtriton.flash_attention_with_lse
    monkeypatch.setattr(flashtriton, "flash_attention_with_lse",
                        lambda *a, sinks=None, **kw: real(*a, **kw, sinks=sinks * 0))
    assert bench_sinks._check(q, k, v, sinks, 7) > TOLERANCE


def test_paged_bench_checks_before_timing(monkeypatch):
    """bench.paged: its pages hold the packed keys, each call it times passes its check, and
    a call over other keys fails it."""
    from flashtriton.bench import paged as bench_paged
    for name, value in (("H", 4), ("HKV", 2), ("D", 16)):
        monkeypatch.setattr(bench_paged, name, value)
    torch.manual_seed(0)
    for seqs in ([(5, 20), (1, 9), (3, 40)], [(1, 30), (1, 7)], [(4, 30), (4, 17)]):
        fns, inputs = bench_paged.calls(seqs, device=DEVICE)
        k, lk = inputs[1], inputs[4]
        pool, table = bench_paged.paged(k, lk, 16, torch.Generator().manual_seed(1))
        first = pool[table[0].long()].flatten(0, 1)[:lk[0]]
        assert torch.equal(first, k[:lk[0]])
        assert ("flash_attn_with_kvcache 16" in fns) == (len({s[0] for s in seqs}) == 1)
        for name, fn in fns.items():
            assert bench_paged.check(fn, inputs) < 1e-2, name
    assert bench_paged.check(lambda: fns["paged 16"]() * 0 + 1, inputs) > common.TOLERANCE


def _e2e_args(**kw):
    from flashtriton.bench import e2e
    args = e2e.parse(["--dims", "16", "--layers", "1", "--hidden", "64", "--vocab", "97",
                      "--train-shapes", "2x24", "--gen-batches", "2", "--prompts", "12",
                      "--new-tokens", "3"])
    for name, value in kw.items():
        setattr(args, name, value)
    return args


def test_e2e_bench_checks_the_models_before_timing(monkeypatch):
    """bench.e2e: a tiny Llama through flashtriton's transformers integration gives the sdpa
    model's logits (the check before any timing, run through the interpreter), and a model
    whose attention is wrong fails it; the diffusion rows check each provider."""
    pytest.importorskip("transformers")
    from flashtriton.bench import e2e
    from flashtriton.integrations import transformers as integration
    meta = {"gpu": "test"}
    args = _e2e_args()
    rows = (e2e.train_rows(args, meta, DEVICE, torch.float32, timed=False)
            + e2e.generate_rows(args, meta, DEVICE, torch.float32, timed=False))
    assert [(r["part"], r["impl"], r["status"]) for r in rows] == [
        ("train", "sdpa", "checked"), ("train", "triton_fa", "checked"),
        ("generate", "sdpa", "checked"), ("generate", "triton_fa", "checked")]
    assert rows[0]["rel_err_vs_sdpa"] == 0 and 0 < rows[1]["rel_err_vs_sdpa"] < 1e-3
    assert rows[3]["same_tokens_as_sdpa"] == 1.0 and 0 < rows[3]["rel_err_vs_sdpa"] < 1e-3
    # the decoding steps on the split-KV kernel (configs.dense_split, its floor lowered to
    # the prompt's 12 keys): generate() gives the sdpa model's tokens
    from flashtriton import configs
    from flashtriton.launch import decode as decode_launch
    monkeypatch.setattr(configs, "DENSE_SPLIT_MIN_KEYS", 12)
    split = []
    real_split = decode_launch.dense_split
    monkeypatch.setattr(decode_launch, "dense_split", lambda *a: split.append(1) or real_split(*a))
    again = e2e.generate_rows(args, meta, DEVICE, torch.float32, timed=False)
    assert split and again[1]["same_tokens_as_sdpa"] == 1.0, again[1]
    monkeypatch.undo()
    real = integration.flash_attention  # an attention whose rows come out reversed
    monkeypatch.setattr(integration, "flash_attention",
                        lambda q, k, v, **kw: real(q, k, v, **kw).flip(1))
    bad = e2e.train_rows(args, meta, DEVICE, torch.float32, timed=False)
    assert bad[1]["status"].startswith("FAILED check"), bad[1]
    shapes = [("cross", 1, 2, 40, 7, 16), ("self", 1, 2, 24, 24, 16)]
    diff = e2e.diffusion_rows(meta, DEVICE, torch.float32, shapes, ("flashtriton", "naive"),
                              timed=False)
    assert [r["status"] for r in diff] == ["checked"] * 4 and all(r["rel_err"] < 1e-3
                                                                  for r in diff)


def test_e2e_table():
    from flashtriton.bench import e2e
    base = dict(part="train", D=64, B=2, N=4096, status="ok")
    rows = [dict(base, impl="sdpa", tokens_per_s=1000.0, peak_step_MiB=900.0,
                 sdpa_backend="flash"),
            dict(base, impl="triton_fa", tokens_per_s=1100.0, peak_step_MiB=800.0),
            dict(part="generate", D=64, B=1, prompt=512, impl="sdpa", status="ok",
                 tokens_per_s=20.0, ms_per_token=50.0, ms_per_token_again=45.0, gpu_busy=0.1,
                 sdpa_backend="math"),
            dict(part="generate", D=64, B=1, prompt=512, impl="triton_fa",
                 status="out of memory"),
            dict(part="diffusion", shape="SDXL cross-attention", provider="flashtriton",
                 status="ok", fwd_tflops=84.4)]
    md = e2e.table(rows)
    assert "| train | 64 | 2 | 4096 | 1000 (flash) | 1100 | 1.10x | 900 / 800 |" in md
    assert "| generate | 64 | 1 | 512 | 20 (22 again) | out of memory | | |" in md
    assert "| SDXL cross-attention | 84 |" in md
    assert "50.00 ms a token (45.00 over the same lengths again)" in e2e._line(rows[2])


def test_tune_grid_lists_each_suites_shapes():
    from flashtriton.bench import tune
    args = type("Args", (), dict(dims=[64, 256], seqlens=[512, 4096], tokens=16384, dmodel=2048,
                                 suites=list(tune.SUITES), decode_batches=[1, 64],
                                 decode_lens=[1024, 65536], decode_max_tokens=1 << 20))
    labels = [label for label, _ in tune.shapes(args)]
    assert len(labels) == len(set(labels))
    assert sum(x.startswith("train ") for x in labels) == 2 * 2 * 2  # dims x lens x causal
    assert sum(x.startswith("varlen ") for x in labels) == 2 * 2      # causal only
    assert sum(x.startswith("generate ") for x in labels) == 2 * 2 * 2  # batches 1 and 8
    # cross-attention from 1024 queries, over each text-key count
    assert [x for x in labels if x.startswith("cross D=64")] == [
        f"cross D=64 queries=4096 keys={n}" for n in tune.CROSS_KEYS]
    # decoding: B x N within decode_max_tokens (64 x 65536 is not), paged or not, fp8 or not
    assert sum(x.startswith("decode ") for x in labels) == 2 * 3 * 4
    assert "decode D=64 B=64 N=65536 paged=0 fp8=0" not in labels


# Every command line of the benchmarks: module, its parser's home, arguments of a no-GPU run.
COMMANDS = [
    pytest.param("flashtriton.bench", "flashtriton.bench.cli", ["--suites", "train"], id="bench"),
    pytest.param("flashtriton.bench.e2e", "flashtriton.bench.e2e", [], id="e2e"),
    pytest.param("flashtriton.bench.sinks", "flashtriton.bench.sinks", [], id="sinks"),
    pytest.param("flashtriton.bench.paged", "flashtriton.bench.paged", [], id="paged"),
    pytest.param("flashtriton.bench.ring", "flashtriton.bench.ring", ["--world", "2"], id="ring"),
    pytest.param("flashtriton.bench.variants", "flashtriton.bench.variants", [], id="variants"),
    pytest.param("flashtriton.bench.tune", "flashtriton.bench.tune", [], id="tune"),
]


def _no_gpu_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("command, home, _argv",
                         COMMANDS + [pytest.param("flashtriton.bench.demo",
                                                  "flashtriton.bench.demo", [], id="demo")])
def test_every_flag_has_help_and_the_usage_names_the_command(command, home, _argv, capsys):
    p = importlib.import_module(home).parser()
    assert p.prog == f"python -m {command}"
    assert [a.option_strings for a in p._actions if not a.help] == []
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {command} [-h]")


@pytest.mark.parametrize("command, home, argv", COMMANDS)
def test_without_a_gpu_a_benchmark_says_so_in_one_line_and_writes_nothing(
        command, home, argv, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(home).main([*argv, "--out", str(out)])
    message = exc.value.code
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"python -m {command} needs ") and "CUDA GPU" in message
    assert not out.exists()


def test_bench_commands_without_a_gpu_and_the_demo_help(tmp_path):
    """As run from a shell: `python -m flashtriton.bench.e2e` without a GPU exits 1 with one
    line on stderr and no output folder; `python -m flashtriton.bench.demo --help` prints its
    usage and exits 0 (before re-running itself under the interpreter)."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "flashtriton.bench.e2e", "--out", str(out)],
                         cwd=tmp_path, env=_no_gpu_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1 and run.stdout == "", run
    assert len(run.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in run.stderr
    assert not out.exists()
    run = subprocess.run([sys.executable, "-m", "flashtriton.bench.demo", "--help"],
                         cwd=tmp_path, env=_no_gpu_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python -m flashtriton.bench.demo")
    assert "check vs float64" not in run.stdout


@pytest.mark.skipif(ON_GPU, reason="the demo's CPU output")
def test_demo_on_the_cpu_checks_and_times_nothing(monkeypatch, capsys):
    """On the CPU the demo reports its checks and the memory arithmetic, and no timings (the
    interpreter's time is not the kernels')."""
    from flashtriton.bench import demo
    monkeypatch.setattr(demo, "_check", lambda *a: {"out": 1e-7, "dq": 2e-7})
    monkeypatch.setattr(demo, "_measure", lambda *a: pytest.fail("timed on the CPU"))
    demo.main([])
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "No timings" in out and " ms" not in out
    assert "2 x 1024.0 MiB" in out and "1.00 MiB" in out
