"""validation.supported: None for calls the kernels run, a reason naming the argument for the
rest; check_qkv raises with the same rules; the SDPA and ComfyUI drop-ins agree with it."""

import pytest
import torch
import torch.nn.functional as F

import flashtriton.sdpa as sdpa_mod
from conftest import DEVICE
from flashtriton import _env, validation
from flashtriton.integrations import comfyui
from flashtriton.validation import MAX_HEAD_DIM, Reason, check_qkv, supported


def _t(*shape, dtype=torch.float16, device=DEVICE):
    return torch.randn(*shape, dtype=dtype, device=device)


def _qkv(shape=(1, 16, 2, 16), kv=None, dtype=torch.float16):
    kv = shape if kv is None else kv
    return _t(*shape, dtype=dtype), _t(*kv, dtype=dtype), _t(*kv, dtype=dtype)


# -- supported on q, k, v --------------------------------------------------------------------

VALID = [
    pytest.param(lambda: _qkv(), {}, id="fp16"),
    pytest.param(lambda: _qkv(dtype=torch.float32), {}, id="fp32"),
    pytest.param(lambda: _qkv(dtype=torch.bfloat16), {}, id="bf16"),
    pytest.param(lambda: _qkv((1, 16, 4, 16), (1, 9, 2, 16)), {}, id="gqa-cross"),
    pytest.param(lambda: _qkv((1, 16, 4, 16), (1, 9, 1, 16)), {}, id="mqa"),
    pytest.param(lambda: _qkv((1, 16, 2, MAX_HEAD_DIM)), {}, id="d-max"),
    pytest.param(lambda: _qkv((1, 16, 2, 1)), {}, id="d1"),
    pytest.param(lambda: _qkv((1, 4, 16, 16), (1, 2, 9, 16)), dict(layout="bhsd"), id="bhsd-gqa"),
    pytest.param(lambda: _qkv((1, 16, 2, 16), (3, 40, 2, 16)), dict(same_batch=False),
                 id="cache-batch"),
    pytest.param(lambda: (_t(1, 2, 16, 16).transpose(1, 2), _t(1, 2, 16, 16).transpose(1, 2),
                          _t(1, 16, 2, 16)), dict(unit_stride=True), id="transposed-views"),
    pytest.param(lambda: tuple(_t(1, 16, 2, 32)[..., ::2] for _ in range(3)), {},
                 id="strided-headdim-copied"),
]


@pytest.mark.parametrize("make,options", VALID)
def test_supported_accepts(make, options):
    q, k, v = make()
    assert supported(q, k, v, **options) is None
    if options.get("layout", "bshd") == "bshd":
        check_qkv(q, k, v, same_batch=options.get("same_batch", True))  # does not raise


# (make q, k, v; options; exception check_qkv raises; words of the reason)
REFUSED = [
    pytest.param(lambda: (_t(1, 16, 2, 16).tolist(), _t(1, 16, 2, 16), _t(1, 16, 2, 16)), {},
                 TypeError, ["q must be a torch.Tensor", "list"], id="not-a-tensor"),
    pytest.param(lambda: (_t(1, 16, 2, 16), _t(16, 2, 16), _t(16, 2, 16)), {},
                 ValueError, ["k must be 4-D", "(16, 2, 16)"], id="k-3d"),
    pytest.param(lambda: (_t(1, 1, 16, 2, 16),) * 3, {}, ValueError, ["q must be 4-D"],
                 id="q-5d"),
    pytest.param(lambda: _qkv(dtype=torch.float64), {}, TypeError,
                 ["q has unsupported dtype torch.float64"], id="fp64"),
    pytest.param(lambda: tuple(torch.ones(1, 16, 2, 16, dtype=torch.int32, device=DEVICE)
                               for _ in range(3)), {}, TypeError,
                 ["q has unsupported dtype torch.int32"], id="int32"),
    pytest.param(lambda: (_t(1, 16, 2, 16), _t(1, 16, 2, 16, dtype=torch.float32),
                          _t(1, 16, 2, 16)), {}, TypeError,
                 ["q, k, v must share one dtype", "torch.float32"], id="mixed-dtype"),
    pytest.param(lambda: (_t(1, 16, 2, 16), _t(1, 16, 2, 16, device="meta"), _t(1, 16, 2, 16)),
                 {}, ValueError, ["q, k, v must be on one device", "meta"], id="device-mismatch"),
    pytest.param(lambda: tuple(_t(1, 16, 2, 16, device="meta") for _ in range(3)), {},
                 ValueError, ["q is on device meta"], id="meta-device"),
    pytest.param(lambda: _qkv((1, 16, 2, MAX_HEAD_DIM + 16)), {}, ValueError,
                 [f"headdim must be in 1..{MAX_HEAD_DIM}", str(MAX_HEAD_DIM + 16)], id="d-too-big"),
    pytest.param(lambda: _qkv((1, 16, 2, 0)), {}, ValueError, ["headdim must be in"], id="d0"),
    pytest.param(lambda: _qkv((1, 16, 2, 300)), {}, ValueError,
                 [f"q's headdim must be in 1..{MAX_HEAD_DIM}", "got 300", "q shape (1, 16, 2, 300)"],
                 id="d300-everywhere-names-q"),
    pytest.param(lambda: _qkv((1, 16, 2, 16), (1, 16, 2, 32)), {}, ValueError,
                 ["headdim mismatch"], id="d-mismatch"),
    pytest.param(lambda: _qkv((1, 16, 3, 16), (1, 16, 2, 16)), {}, ValueError,
                 ["nheads of q (3) must be a multiple of nheads of k (2)"], id="heads-indivisible"),
    pytest.param(lambda: _qkv((1, 16, 2, 16), (1, 16, 0, 16)), {}, ValueError,
                 ["k has no heads", "the 2 heads of q"], id="no-kv-heads"),
    pytest.param(lambda: (_t(1, 16, 2, 16), _t(1, 16, 2, 16), _t(1, 9, 2, 16)), {}, ValueError,
                 ["k and v must have the same shape"], id="kv-shapes"),
    pytest.param(lambda: _qkv((1, 16, 2, 16), (2, 16, 2, 16)), {}, ValueError,
                 ["batch mismatch"], id="batch"),
]


@pytest.mark.parametrize("make,options,exc,words", REFUSED)
def test_supported_refuses_naming_the_argument(make, options, exc, words):
    q, k, v = make()
    reason = supported(q, k, v, **options)
    assert isinstance(reason, Reason) and reason.error is exc
    for word in words:
        assert word in reason, (word, reason)
    # check_qkv raises the same rule, with the same message and exception class
    with pytest.raises(exc) as info:
        check_qkv(q, k, v)
    assert str(info.value) == reason


def test_names_are_the_callers():
    q, k, v = _qkv(dtype=torch.float64)
    assert supported(q, k, v, names=("query", "key", "value")).startswith("query has ")
    with pytest.raises(TypeError, match="^query has unsupported dtype"):
        check_qkv(q, k, v, names=("query", "key", "value"))


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(_env, "INTERPRET", False)
    q = torch.randn(1, 16, 2, 16, dtype=torch.float16)
    assert "TRITON_INTERPRET=1" in supported(q, q, q)


def test_layout_picks_the_heads_axis():
    q, k, v = _qkv((1, 3, 16, 16), (1, 2, 16, 16))  # 3 and 2 heads in (B, H, N, D)
    assert supported(q, k, v) is None                 # (B, N, H, D): 16 heads each
    assert "nheads of q (3) must be a multiple of nheads of k (2)" in supported(
        q, k, v, layout="bhsd")
    assert "(batch, nheads, seqlen, headdim)" in supported(q[0], k, v, layout="bhsd")
    with pytest.raises(ValueError, match="layout"):
        supported(q, k, v, layout="bsd")


def test_unit_stride_refuses_a_strided_headdim():
    q, k, v = _qkv((1, 16, 2, 32))
    k = k[..., ::2]
    q, v = q[..., :16], v[..., :16]
    assert supported(q, k, v) is None  # the entry points copy it
    assert validation.unit_last(k).stride(-1) == 1 and validation.unit_last(q) is q
    reason = supported(q, k, v, unit_stride=True)
    assert reason.startswith("k must have a unit stride on headdim") and str(k.stride()) in reason


# -- supported's options ----------------------------------------------------------------------

def _mask(*shape, dtype=torch.bool, **kw):
    return (torch.rand(*shape, device=kw.pop("device", DEVICE)) > 0.3).to(dtype).requires_grad_(
        kw.pop("requires_grad", False))


OPTIONS_OK = [
    dict(attn_mask=_mask(16, 16, device="cpu")),
    dict(attn_mask=_mask(1, 1, 16, 16, dtype=torch.float32, device="cpu")),
    dict(attn_mask=_mask(2, 1, 16, device="cpu")),
    dict(dropout_p=0.0), dict(dropout_p=0.5), dict(dropout_p=torch.tensor(0.25)),
    dict(softmax_scale=0.3), dict(window_size=(4, 0)), dict(softcap=30.0),
    dict(alibi_slopes=torch.ones(2)),
]


@pytest.mark.parametrize("options", OPTIONS_OK, ids=lambda o: next(iter(o)))
def test_supported_options_accept(options):
    q, k, v = _qkv()
    options = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) and name != "dropout_p" else x
               for name, x in options.items()}
    assert supported(q, k, v, **options) is None


OPTIONS_REFUSED = [
    pytest.param(dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor",
                 id="mask-list"),
    pytest.param(dict(attn_mask=_mask(16, 16, dtype=torch.float16, requires_grad=True)),
                 ValueError, "attn_mask requires grad", id="mask-grad"),
    pytest.param(dict(attn_mask=_mask(16, 16, dtype=torch.int64)), TypeError,
                 "attn_mask has dtype torch.int64", id="mask-int"),
    pytest.param(dict(attn_mask=_mask(16, 16, device="meta")), ValueError,
                 "attn_mask must be on the device", id="mask-device"),
    pytest.param(dict(attn_mask=_mask(16, 15)), ValueError,
                 "attn_mask of shape (16, 15) does not broadcast to", id="mask-shape"),
    pytest.param(dict(attn_mask=_mask(2, 2, 16, 16)), ValueError,
                 "attn_mask of shape (2, 2, 16, 16) does not broadcast to (batch, nheads, "
                 "seqlen_q, seqlen_k) = (1, 2, 16, 16)", id="mask-bigger-batch"),
    pytest.param(dict(attn_mask=_mask(1, 1, 2, 16, 16)), ValueError, "does not broadcast",
                 id="mask-5d"),
    pytest.param(dict(attn_mask=[[True]], mask_name="mask"), TypeError, "mask must be",
                 id="mask-name"),
    pytest.param(dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)", id="dropout-1"),
    pytest.param(dict(dropout_p=-0.1), ValueError, "dropout_p must be in [0, 1)", id="dropout-neg"),
    pytest.param(dict(dropout_p=float("nan")), ValueError, "dropout_p", id="dropout-nan"),
    pytest.param(dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number",
                 id="dropout-str"),
    pytest.param(dict(dropout_p=True), TypeError, "dropout_p must be a real number",
                 id="dropout-bool"),
    pytest.param(dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite",
                 id="scale-inf"),
    pytest.param(dict(softmax_scale="0.1"), TypeError, "softmax_scale", id="scale-str"),
    pytest.param(dict(window_size=(-2, 1)), ValueError, "window_size", id="window"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap must be >= 0", id="softcap"),
    pytest.param(dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape",
                 id="alibi-shape"),
]


@pytest.mark.parametrize("options,exc,words", OPTIONS_REFUSED)
def test_supported_options_refuse(options, exc, words):
    q, k, v = _qkv()
    if "alibi_slopes" in options:
        options = dict(alibi_slopes=options["alibi_slopes"].to(DEVICE))
    reason = supported(q, k, v, **options)
    assert reason is not None and words in reason and reason.error is exc, reason


def test_mask_target_follows_the_layout():
    q, k, v = _qkv((1, 2, 16, 16), (1, 2, 9, 16))  # (B, H, N, D): SQ 16, SK 9
    assert supported(q, k, v, layout="bhsd", attn_mask=_mask(16, 9)) is None
    assert "(1, 2, 16, 9)" in supported(q, k, v, layout="bhsd", attn_mask=_mask(2, 9))
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # the same call in (B, N, H, D)
    assert supported(q, k, v, attn_mask=_mask(16, 9)) is None


# -- flags: bool, numpy bool or a 0-d bool CPU tensor, else a TypeError naming them ------------

def test_check_flag_takes_bools_only():
    np = pytest.importorskip("numpy")
    for value, want in ((True, True), (False, False), (np.bool_(True), True),
                        (np.False_, False), (torch.tensor(True), True),
                        (torch.tensor(False), False)):
        assert validation.check_flag("causal", value) is want
    for bad in ("yes", None, 1, 0, 1.0, torch.tensor([True]), torch.tensor(1),
                torch.tensor(True, device="meta")):  # (meta: a device tensor, read = a sync)
        with pytest.raises(TypeError, match="^causal must be a bool"):
            validation.check_flag("causal", bad)


def _flag_calls():
    """Each public entry point with flags: (its flags, a function calling it with one flag's
    value, the tensors and host state an error must leave unchanged)."""
    from flashtriton import (distributed, explain, flash_attention, flash_attention_varlen,
                             flash_attention_varlen_with_lse, flash_attention_with_lse,
                             scaled_dot_product_attention)
    from flashtriton.compat import flash_attn as fa
    from flashtriton.decode import PagedKVCache, attention_with_kvcache
    torch.manual_seed(0)  # the same tensors on every call
    q, k, v = _qkv((1, 4, 2, 16))
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    out = _t(4, 2, 16)
    cache = _t(1, 16, 2, 16), _t(1, 16, 2, 16)
    new = _t(1, 1, 2, 16), _t(1, 1, 2, 16)
    lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    paged = PagedKVCache(num_pages=4, page_size=8, num_kv_heads=2, head_dim=16,
                         dtype=torch.float16, device=DEVICE)
    paged.add(0)
    kv, qkv = torch.stack((k, v), 2), torch.stack((q, k, v), 2)
    dense = ("causal", "deterministic", "batch_invariant")
    fa_dense = ("causal", "deterministic", "return_attn_probs")
    kvcache = ("causal", "return_lse", "rotary_interleaved", "batch_invariant")
    ring = ("causal", "return_lse", "deterministic")
    return {
        "flash_attention": (dense, lambda **f: flash_attention(q, k, v, **f), ()),
        "flash_attention_with_lse": (dense, lambda **f: flash_attention_with_lse(q, k, v, **f),
                                     ()),
        "flash_attention_varlen": (dense, lambda **f: flash_attention_varlen(
            q[0], k[0], v[0], cu, cu, 4, 4, out=out, **f), (out,)),
        "flash_attention_varlen_with_lse": (dense, lambda **f: flash_attention_varlen_with_lse(
            q[0], k[0], v[0], cu, cu, 4, 4, **f), ()),
        "attention_with_kvcache": (kvcache, lambda **f: attention_with_kvcache(
            q[:, :1], *cache, *new, cache_seqlens=lens, **f), cache),
        "PagedKVCache.attend": (("causal", "rotary_interleaved", "batch_invariant"),
                                lambda **f: paged.attend(q[:, :1], *new, [0], **f),
                                (paged.k, paged.v, paged._free, paged._pages)),
        "flash_attn_func": (fa_dense, lambda **f: fa.flash_attn_func(q, k, v, **f), ()),
        "flash_attn_kvpacked_func": (fa_dense, lambda **f: fa.flash_attn_kvpacked_func(
            q, kv, **f), ()),
        "flash_attn_qkvpacked_func": (fa_dense, lambda **f: fa.flash_attn_qkvpacked_func(
            qkv, **f), ()),
        "flash_attn_varlen_func": (fa_dense + ("return_softmax_lse",),
                                   lambda **f: fa.flash_attn_varlen_func(
                                       q[0], k[0], v[0], cu, cu, 4, 4, **f), ()),
        "flash_attn_varlen_kvpacked_func": (fa_dense, lambda **f:
                                            fa.flash_attn_varlen_kvpacked_func(
                                                q[0], kv[0], cu, cu, 4, 4, **f), ()),
        "flash_attn_varlen_qkvpacked_func": (fa_dense, lambda **f:
                                             fa.flash_attn_varlen_qkvpacked_func(
                                                 qkv[0], cu, 4, **f), ()),
        "flash_attn_with_kvcache": (("causal", "rotary_interleaved", "return_softmax_lse"),
                                    lambda **f: fa.flash_attn_with_kvcache(
                                        q[:, :1], *cache, *new, cache_seqlens=lens, **f),
                                    cache),
        "scaled_dot_product_attention": (("is_causal", "enable_gqa"), lambda **f:
                                         scaled_dot_product_attention(
                                             q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), **f), ()),
        "explain": (dense, lambda **f: explain(q, k, v, **f), ()),
        "ring_attention": (ring, lambda **f: distributed.ring_attention(q, k, v, **f), ()),
        "ring_flash_attn_func": (fa_dense, lambda **f: distributed.ring_flash_attn_func(
            q, k, v, **f), ()),
        "zigzag_ring_flash_attn_func": (fa_dense, lambda **f:
                                        distributed.zigzag_ring_flash_attn_func(q, k, v, **f),
                                        ()),
    }


def _snapshot(state):
    return [x.clone() if isinstance(x, torch.Tensor) else repr(x) for x in state]


FLAG_ENTRIES = [pytest.param(name, id=name) for name in (
    "flash_attention", "flash_attention_with_lse", "flash_attention_varlen",
    "flash_attention_varlen_with_lse", "attention_with_kvcache", "PagedKVCache.attend",
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
    "scaled_dot_product_attention", "explain", "ring_attention", "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func")]


@pytest.mark.parametrize("entry", FLAG_ENTRIES)
def test_every_flag_refuses_what_is_not_a_bool(entry):
    """Each flag of each entry point: a string, None, an int or a 1-element tensor raises
    TypeError naming the flag, before any launch or write (caches, out=, the page pool)."""
    flags, call, state = _flag_calls()[entry]
    before = _snapshot(state)
    for flag in flags:
        for bad in ("yes", None, 1, torch.tensor([True])):
            with pytest.raises(TypeError, match=f"^{flag} must be a bool"):
                call(**{flag: bad})
    after = _snapshot(state)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(before, after))


def test_supported_refuses_flags_that_are_not_bools():
    q, k, v = _qkv()
    for flag in ("causal", "deterministic", "batch_invariant"):
        reason = supported(q, k, v, **{flag: "yes"})
        assert reason.error is TypeError and reason.startswith(f"{flag} must be a bool")
        assert supported(q, k, v, **{flag: True}) is None


@pytest.mark.parametrize("entry,flag", [("flash_attention", "causal"),
                                        ("attention_with_kvcache", "causal"),
                                        ("scaled_dot_product_attention", "is_causal")])
def test_numpy_and_cpu_tensor_flags_act_as_bools(entry, flag):
    np = pytest.importorskip("numpy")
    _, call, _ = _flag_calls()[entry]
    want = call(**{flag: True})
    want = want[0] if isinstance(want, tuple) else want
    for value in (np.bool_(True), torch.tensor(True)):
        got = _flag_calls()[entry][1](**{flag: value})  # (fresh caches: the append again)
        got = got[0] if isinstance(got, tuple) else got
        assert torch.equal(got, want), value


# -- the drop-ins agree with supported --------------------------------------------------------

@pytest.fixture
def routes(monkeypatch):
    """Which path each drop-in call took: the kernels (sdpa's _run) or torch's SDPA."""
    taken = []
    real_run, real_torch = sdpa_mod._run, sdpa_mod._TORCH_SDPA
    monkeypatch.setattr(sdpa_mod, "_run", lambda *a, **kw: taken.append("kernels")
                        or real_run(*a, **kw))
    monkeypatch.setattr(sdpa_mod, "_TORCH_SDPA", lambda *a, **kw: taken.append("torch")
                        or real_torch(*a, **kw))
    return taken


def _bhnd_cases():
    """(id, q, k, v) in SDPA's (B, H, N, D) layout that supported refuses."""
    return [
        ("fp64", *_qkv((1, 2, 16, 16), dtype=torch.float64)),
        ("mixed-dtype", _t(1, 2, 16, 16), _t(1, 2, 16, 16, dtype=torch.float32),
         _t(1, 2, 16, 16)),
        ("d-too-big", *_qkv((1, 2, 16, MAX_HEAD_DIM + 16))),
        ("heads-indivisible", *_qkv((1, 3, 16, 16), (1, 2, 16, 16))),
        ("device-mismatch", _t(1, 2, 16, 16), _t(1, 2, 16, 16, device="meta"),
         _t(1, 2, 16, 16, device="meta")),
        ("k-3d", _t(1, 2, 16, 16), _t(2, 16, 16), _t(2, 16, 16)),
    ]


@pytest.mark.parametrize("case", range(len(_bhnd_cases())),
                         ids=[c[0] for c in _bhnd_cases()])
def test_adapters_refuse_what_supported_refuses(case, routes):
    _, q, k, v = _bhnd_cases()[case]
    reason = supported(q, k, v, names=("query", "key", "value"), layout="bhsd")
    assert reason is not None
    assert sdpa_mod.sdpa_misfit(q, k, v, enable_gqa=True) == reason
    try:
        sdpa_mod.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except (RuntimeError, NotImplementedError):
        pass  # torch's own error: what torch does, we do
    assert routes == ["torch"]
    # ComfyUI with (B, H, N, D) inputs: the same rule, ComfyUI's own function runs it
    assert comfyui.misfit(q, k, v, 2, skip_reshape=True) == supported(q, k, v, layout="bhsd")
    assert comfyui.supported(q, k, v, 2, skip_reshape=True) is False
    assert comfyui.attention_override(lambda *a, **kw: "comfy", q, k, v, 2,
                                      skip_reshape=True) == "comfy"
    assert routes == ["torch"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_runs_what_supported_accepts(dtype, mask, routes):
    q, k, v = _qkv((1, 2, 16, 16), dtype=dtype)
    attn_mask = {None: None, "bool": _mask(16, 16),
                 "float": torch.randn(1, 1, 16, 16, device=DEVICE, dtype=dtype)}[mask]
    assert supported(q, k, v, layout="bhsd", attn_mask=attn_mask) is None
    assert sdpa_mod.sdpa_misfit(q, k, v, attn_mask) is None
    out = sdpa_mod.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    assert routes == ["kernels"]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                         attn_mask=attn_mask if mask != "float"
                                         else attn_mask.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("case", ["gqa-without-flag", "mask-dtype", "mask-with-causal"])
def test_sdpa_adds_torchs_refusals(case, routes):
    """Calls the kernels could run but torch refuses: torch's function runs them."""
    q, k, v = _qkv((1, 2, 16, 16), dtype=torch.float32)
    kwargs = {}
    if case == "gqa-without-flag":
        q = _t(1, 4, 16, 16, dtype=torch.float32)
        assert supported(q, k, v, layout="bhsd") is None
        assert "enable_gqa" in sdpa_mod.sdpa_misfit(q, k, v)
    elif case == "mask-dtype":
        kwargs["attn_mask"] = _mask(16, 16, dtype=torch.float16)
        assert "float16" in sdpa_mod.sdpa_misfit(q, k, v, **kwargs)
    else:
        kwargs.update(attn_mask=_mask(16, 16), is_causal=True)
        assert "is_causal" in sdpa_mod.sdpa_misfit(q, k, v, **kwargs)
    assert supported(q, k, v, layout="bhsd", attn_mask=kwargs.get("attn_mask")) is None
    try:
        sdpa_mod.scaled_dot_product_attention(q, k, v, **kwargs)
    except RuntimeError:
        pass
    assert routes == ["torch"]


def _flat(C_q=2 * 16, C_kv=None, N=16, M=16, dtype=torch.float16):
    C_kv = C_q if C_kv is None else C_kv
    return _t(1, N, C_q, dtype=dtype), _t(1, M, C_kv, dtype=dtype), _t(1, M, C_kv, dtype=dtype)


COMFY_REFUSED = [
    pytest.param(lambda: _flat(dtype=torch.float64), dict(heads=2), "q has unsupported dtype",
                 id="fp64"),
    pytest.param(lambda: _flat(2 * 16, 4 * 16), dict(heads=2),
                 "nheads of q (2) must be a multiple of nheads of k (4)", id="kv-more-heads"),
    pytest.param(lambda: _flat(2 * 16, 24), dict(heads=2),
                 "k's 24 channels do not split into heads of q's head dim 16", id="kv-channels"),
    pytest.param(lambda: _flat(MAX_HEAD_DIM + 16), dict(heads=1),
                 f"headdim must be in 1..{MAX_HEAD_DIM}", id="d-too-big"),
    pytest.param(lambda: _flat(33), dict(heads=2), "q's 33 channels do not split into 2 heads",
                 id="indivisible"),
    pytest.param(lambda: _flat(), dict(heads=None), "heads must be a positive int",
                 id="heads-none"),
    pytest.param(lambda: _qkv((1, 16, 32)), dict(heads=2, skip_reshape=True), "q must be 4-D",
                 id="skip-reshape-3d"),
    pytest.param(lambda: _qkv((1, 3, 16, 16), (1, 2, 16, 16)), dict(heads=3, skip_reshape=True),
                 "nheads of q (3) must be a multiple of nheads of k (2)", id="gqa-indivisible"),
    pytest.param(lambda: _flat(), dict(heads=2, mask=_mask(16, 16, dtype=torch.float16,
                                                           requires_grad=True)),
                 "mask requires grad", id="mask-grad"),
    pytest.param(lambda: _flat(), dict(heads=2, mask=_mask(2, 16, 16)),
                 "mask of shape (2, 1, 16, 16) does not broadcast", id="mask-batch"),
]


@pytest.mark.parametrize("make,call,words", COMFY_REFUSED)
def test_comfyui_falls_back_for_what_supported_refuses(make, call, words, routes):
    q, k, v = make()
    heads, rest = call["heads"], {n: x for n, x in call.items() if n != "heads"}
    reason = comfyui.misfit(q, k, v, heads, **rest)
    assert reason is not None and words in reason, reason
    assert comfyui.supported(q, k, v, heads, **rest) is False
    got = comfyui.attention_override(lambda *a, **kw: ("comfy", a, kw), q, k, v, heads, **rest)
    assert got[0] == "comfy" and got[1][3] == heads and routes == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("form", ["flat", "flat-mask", "bhnd-gqa"])
def test_comfyui_runs_what_supported_accepts(dtype, form, routes):
    if form == "bhnd-gqa":
        q, k, v = _qkv((1, 2, 16, 16), (1, 1, 16, 16), dtype=dtype)
        call, views = dict(skip_reshape=True, skip_output_reshape=True), (q, k, v)
    else:
        q, k, v = _flat(dtype=dtype)
        call = dict(mask=_mask(1, 16, 16)) if form == "flat-mask" else {}
        views = tuple(x.view(1, 16, 2, 16).transpose(1, 2) for x in (q, k, v))
    mask = call.get("mask")
    assert supported(*views, layout="bhsd",
                     attn_mask=None if mask is None else mask[:, None]) is None
    fit = {n: x for n, x in call.items() if n != "skip_output_reshape"}
    assert comfyui.misfit(q, k, v, 2, **fit) is None and comfyui.supported(q, k, v, 2, **fit)

    def theirs(*a, **kw):
        raise AssertionError("ComfyUI's own attention ran a supported call")
    out = comfyui.attention_override(theirs, q, k, v, 2, **call)
    assert routes == ["kernels"] and out.shape == q.shape and out.dtype == dtype
    kk, vv = views[1].repeat_interleave(2 // views[1].shape[1], 1), views[2]
    vv = vv.repeat_interleave(2 // vv.shape[1], 1)
    ref = F.scaled_dot_product_attention(views[0].double(), kk.double(), vv.double(),
                                         attn_mask=None if mask is None else mask[:, None])
    if form != "bhnd-gqa":
        ref = ref.transpose(1, 2).reshape(q.shape)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)


def test_comfyui_positional_mask_is_seen(routes):
    """attention_override reads the mask however ComfyUI passes it (here positionally)."""
    q, k, v = _flat()
    mask = _mask(16, 16, dtype=torch.float16, requires_grad=True)
    got = comfyui.attention_override(lambda *a, **kw: "comfy", q, k, v, 2, mask)
    assert got == "comfy" and routes == []
