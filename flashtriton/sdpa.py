"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``."""

import contextvars
from typing import Optional

import torch
import torch.nn.functional as F

from . import _env
from .api import _run
from .validation import check_flag, supported

# torch's own function, captured at import: the fall-back target, also while patched.
_TORCH_SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value")


def sdpa_misfit(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                enable_gqa=False, scale=None) -> Optional[str]:
    """Why ``scaled_dot_product_attention`` sends this call to torch's function instead of
    the kernels, or None where the kernels run it: ``validation.supported`` on SDPA's
    (batch, heads, seqlen, headdim) layout, then the calls torch itself refuses."""
    reason = supported(query, key, value, names=_NAMES, layout="bhsd", own_v_dim=True,
                       attn_mask=attn_mask, dropout_p=dropout_p, softmax_scale=scale)
    if reason is not None:
        return reason
    H, HK = query.shape[1], key.shape[1]
    if HK != H and not enable_gqa:
        return f"{H} query heads and {HK} key heads without enable_gqa (torch raises)"
    if attn_mask is not None:
        if is_causal:
            return "attn_mask with is_causal (torch raises)"
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            return (f"attn_mask is {attn_mask.dtype}; torch's SDPA takes bool or query's "
                    f"{query.dtype}")
    return None


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch's SDPA signature and (batch, heads, seqlen, headdim) layout.

    Routed to flashtriton's kernels when all hold: query/key/value are 4-D,
    float16/bfloat16/float32, on one CUDA device (or the CPU under
    TRITON_INTERPRET=1), key and value of one shape with query's batch and
    key of query's head dim (<= 256; value's may differ, as torch's Ev), heads equal (or a multiple with ``enable_gqa=True``),
    ``scale`` None or a finite number, ``0 <= dropout_p < 1`` (the kernels' own RNG:
    statistically torch's dropout, not its exact mask), and ``attn_mask`` None or a mask
    the kernels read tile by tile in place:
    boolean (True = attend) or additive in query's dtype, broadcastable to
    (batch, heads, L, S) -- (L, S), (batch, 1, L, S), ... -- and not requiring
    grad. A row that the mask empties gives 0, as torch's math path does.

    ``is_causal`` follows torch: query i sees keys j <= i (top-left aligned), also when
    L != S (the kernels' causal mask is bottom-right aligned, flash-attn's rule: for L < S
    the keys past L are invisible and are dropped; for L > S the queries past S see every
    key and run without the mask).

    Everything else (``sdpa_misfit`` says why, at debug level) falls back to
    ``torch.nn.functional.scaled_dot_product_attention`` with the same arguments, so
    behaviour matches torch's, errors included.
    """
    is_causal = check_flag("is_causal", is_causal)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    reason = sdpa_misfit(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, scale)
    if reason is not None:
        _env.logger.debug("scaled_dot_product_attention falls back to torch's: %s", reason)
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, **kwargs)
    if attn_mask is not None:  # a broadcast view: no (B, H, L, S) copy
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    L, S = q.shape[1], k.shape[1]
    if is_causal and L < S:  # top-left: keys >= L are seen by no query
        k, v = k[:, :L], v[:, :L]
    if is_causal and L > S:  # top-left: queries >= S see every key
        parts = [_sdpa_run(q[:, :S], k, v, True, scale, dropout_p),
                 _sdpa_run(q[:, S:], k, v, False, scale, dropout_p)]
        return torch.cat(parts, dim=1).transpose(1, 2)
    return _sdpa_run(q, k, v, is_causal, scale, dropout_p, attn_mask).transpose(1, 2)


def _sdpa_run(q, k, v, causal, scale, dropout_p, attn_mask=None):
    return _run(q, k, v, causal, scale, dropout_p=dropout_p, names=("query", "key", "value"),
                attn_mask=attn_mask, qkv_checked=True).out  # (sdpa_misfit checked them)


class _SDPAPatch:
    """Handle of ``patch_sdpa()``: ``restore()``, or use it as a context manager."""

    def __init__(self):
        self._previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention

    def restore(self) -> None:
        F.scaled_dot_product_attention = self._previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


# How many forwards of patched modules the current thread / task is inside: SDPA calls made
# while it is > 0 go to the kernels, the others to the function the scoped route replaced.
_SCOPE_DEPTH = contextvars.ContextVar("flashtriton_sdpa_scope_depth", default=0)


class _ScopedRoute:
    """The one function that ``patch_sdpa(module)`` puts in place of torch's SDPA while any
    scoped patch is alive: it reads ``_SCOPE_DEPTH`` and sends each call to the kernels'
    drop-in or to the function it replaced."""

    handles = 0
    previous = None
    # True where other code replaced the function after ours, so that the last restore could
    # not take ours out: it stays in that code's chain, forwarding to ``previous``, and a later
    # scoped patch reuses it rather than wrapping the chain (which would call itself).
    chained = False

    @classmethod
    def acquire(cls) -> None:
        if cls.handles == 0 and not cls.chained:
            cls.previous = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _scoped_sdpa
        cls.handles += 1

    @classmethod
    def release(cls) -> None:
        cls.handles -= 1
        if cls.handles == 0:
            cls.chained = F.scaled_dot_product_attention is not _scoped_sdpa
            if not cls.chained:
                F.scaled_dot_product_attention = cls.previous


def _scoped_sdpa(*args, **kwargs):
    if _SCOPE_DEPTH.get() > 0:
        return scaled_dot_product_attention(*args, **kwargs)
    return _ScopedRoute.previous(*args, **kwargs)


def _enter_scope(module, args):
    _SCOPE_DEPTH.set(_SCOPE_DEPTH.get() + 1)


def _leave_scope(module, args, output):
    # never below 0: a global pre-hook that raised before ours still calls this hook
    _SCOPE_DEPTH.set(max(_SCOPE_DEPTH.get() - 1, 0))


class _ModuleSDPAPatch:
    """Handle of ``patch_sdpa(module)``: ``restore()``, or use it as a context manager."""

    def __init__(self, module: torch.nn.Module):
        _ScopedRoute.acquire()
        self._hooks = [module.register_forward_pre_hook(_enter_scope, prepend=True),
                       module.register_forward_hook(_leave_scope, always_call=True)]

    def restore(self) -> None:
        """Remove the hooks; torch's function is back once no scoped patch is left. A second
        call does nothing."""
        if not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        _ScopedRoute.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def patch_sdpa(module: Optional[torch.nn.Module] = None):
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through flashtriton: for the
    whole process, or with ``module`` only for the calls made inside that module's forward.

        flashtriton.patch_sdpa()             # from here on (handle.restore() undoes it)
        with flashtriton.patch_sdpa():       # or only inside the block
            model(x)
        with flashtriton.patch_sdpa(unet):   # only SDPA calls inside unet(...)
            pipe(prompt)                     # the text encoders keep torch's SDPA

    Calls the kernels support go to them; the rest go to torch's original function (see
    ``scaled_dot_product_attention``).

    With ``module`` (any ``torch.nn.Module``: a diffusers UNet or transformer, a
    transformers model), a forward pre-hook and an always-called forward hook mark, per
    thread and asyncio task, when a forward of ``module`` is running, and torch's function is
    replaced by one that routes only the calls made there; other modules' calls go to the
    function that was in place before, also when they run in another thread at the same
    time. Several modules can be patched at once; the returned handle's ``restore()`` (or the
    end of a ``with`` block) removes this module's hooks, and the last one restored puts the
    previous function back. Only calls through ``module.__call__`` are seen
    (``module.forward(x)`` bypasses hooks).

    Code that imported the function itself
    (``from torch.nn.functional import scaled_dot_product_attention``) before the patch
    keeps torch's.
    """
    if module is None:
        return _SDPAPatch()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"patch_sdpa: module must be a torch.nn.Module or None, "
                        f"got {type(module).__name__}")
    return _ModuleSDPAPatch(module)
