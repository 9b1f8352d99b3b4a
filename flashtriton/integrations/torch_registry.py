"""torch's flash-attention registry (torch >= 2.11): flashtriton's kernels behind aten's
flash-attention operators.

    import flashtriton                                   # registers "flashtriton"
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl("flashtriton")         # aten's flash operators run flashtriton
    ...
    restore_flash_attention_impl()                       # torch's own kernels again

``import flashtriton`` registers the name (``register``) and changes nothing else; activation
calls ``activate``, which puts Python kernels for these operators on the CUDA dispatch key
through one ``torch.library.Library`` (as torch's own FA4 provider does). The registry keeps its
``Handle``; ``restore_flash_attention_impl()``, or activating another implementation, removes
the library and with it every kernel it added.

| aten operator                                    | called by                                  |
|--------------------------------------------------|--------------------------------------------|
| ``_scaled_dot_product_flash_attention``          | SDPA's flash backend, ``context_parallel`` |
| ``_scaled_dot_product_flash_attention_backward`` | their backward                             |
| ``_flash_attention_forward``                     | ``varlen_attn``                            |
| ``_flash_attention_backward``                    | their backward                             |
| ``_flash_attention_forward_no_dropout_inplace``  | ``varlen_attn_out`` (where torch has it)   |

Results keep aten's conventions: (batch, seqlen, heads, headdim) tensors ((batch, heads, seqlen,
headdim) for the SDPA operators), or packed (total, heads, headdim) ones with int32
``cum_seq_q`` / ``cum_seq_k``; the output in the query's memory layout; the LSE float32 (batch,
heads, seqlen_q), or (heads, total_q) when packed, +inf for rows that see no key (flash-attn's
value, which aten's backward and ``context_parallel``'s merge read); a zero Philox seed (2,) and
offset () of uint64, as aten returns for calls without dropout; an empty debug mask. The backward
is flashtriton's, computed from the forward's out and LSE, bitwise repeatable under
``torch.use_deterministic_algorithms(True)``.

A call the kernels cannot take runs the kernel the operator had before activation (torch's own),
and the reason is logged at debug level on the ``flashtriton`` logger: dropout (aten's backward
rebuilds torch's dropout mask from its Philox state), ``return_debug_mask``, ``alibi_slopes``
(aten's backward operator does not take them), a newer torch's options that are not None
(``block_table``, ``num_splits``, ...), and what ``validation.supported`` refuses (dtypes, head
dims, devices, ...).
"""

import warnings
from typing import Optional

import torch

from .. import _env
from ..api import _run_backward, flash_attention_varlen_with_lse, flash_attention_with_lse
from ..validation import describe, supported

NAME = "flashtriton"
_NAMES = ("query", "key", "value")
# Options of aten's flash operators that these kernels leave to torch's, and why.
_LEFT_TO_TORCH = {
    "return_debug_mask": "the attention probabilities are never stored",
    "alibi_slopes": "aten's backward operator does not take them",
}


class Handle:
    """What ``activate`` gives torch's registry, which keeps it while "flashtriton" is active:
    ``remove()`` takes the kernels out of the dispatcher (the operators' previous kernels run
    again)."""

    def __init__(self, library: torch.library.Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def register() -> bool:
    """Register ``activate`` as "flashtriton" in torch's flash-attention registry, without
    activating it (``import flashtriton`` calls this). False where torch has no registry
    (torch < 2.11)."""
    try:
        from torch.nn.attention import register_flash_attention_impl
    except ImportError:
        return False
    register_flash_attention_impl(NAME, register_fn=activate)
    return True


def activate(dispatch_key: str = "CUDA") -> Handle:
    """Put flashtriton's kernels on aten's flash-attention operators for ``dispatch_key``;
    torch's ``activate_flash_attention_impl("flashtriton")`` calls it. Each falls back to the
    kernel the operator had here before (if any: a CPU build of torch has no CUDA kernels, and
    the calls the kernels cannot take then raise RuntimeError). ``Handle.remove()`` undoes it."""
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    try:
        with warnings.catch_warnings():  # (torch warns that a kernel is overridden: the point)
            warnings.filterwarnings("ignore", "Warning only once for all operators")
            for name, impl in _KERNELS.items():
                if hasattr(torch.ops.aten, name):  # (the in-place forward: newer torch only)
                    # (over another Python kernel too: that one is the fallback)
                    library.impl(name, _kernel(name, impl, dispatch_key), dispatch_key,
                                 with_keyset=True, allow_override=True)
    except BaseException:
        library._destroy()
        raise
    return Handle(library)


def _kernel(name: str, impl, dispatch_key: str):
    """The dispatcher's kernel for aten::name: ``impl``, or where it returns a reason (a str)
    the operator's previous kernel with the same arguments."""
    try:
        previous = torch.library.get_kernel(f"aten::{name}", dispatch_key)
    except RuntimeError:  # none for this key
        previous = None

    def kernel(keyset, *args, **kwargs):
        result = impl(*args, **kwargs)
        if not isinstance(result, str):
            return result
        _env.logger.debug("aten::%s runs torch's kernel, not flashtriton's: %s", name, result)
        if previous is None:
            raise RuntimeError(f"flashtriton cannot run this aten::{name} call ({result}) and "
                               f"the operator has no other {dispatch_key} kernel")
        return previous.call_boxed(keyset, *args, **kwargs)

    return kernel


def _window(left, right) -> tuple:
    """aten's window bounds (None or -1: unbounded) as flashtriton's (left, right)."""
    return (-1 if left is None else left, -1 if right is None else right)


def _option_misfit(dropout_p, options: dict) -> Optional[str]:
    """Why the kernels leave a call with these options to torch's, or None."""
    if dropout_p != 0:
        return (f"dropout_p={dropout_p} (aten's backward rebuilds torch's dropout mask from its "
                f"Philox state)")
    for name, value in options.items():
        if value is not None and value is not False:
            shown = describe(value) if isinstance(value, torch.Tensor) else repr(value)
            why = _LEFT_TO_TORCH.get(name, "an option this provider leaves to torch's kernel")
            return f"{name}={shown} ({why})"
    return None


def _index_misfit(name: str, x, numel: int, device) -> Optional[str]:
    if (isinstance(x, torch.Tensor) and x.dim() == 1 and x.numel() == numel
            and x.dtype == torch.int32 and x.device == device):
        return None
    got = describe(x) if isinstance(x, torch.Tensor) else type(x).__name__
    return f"{name} must be a 1-D int32 tensor of {numel} on the query's device; got {got}"


def _misfit(q, k, v, cum_seq_q, cum_seq_k, scale, window, seqused_k=None) -> Optional[str]:
    """Why the kernels cannot run attention over (batch, seqlen, heads, headdim) q, k, v, or
    packed (total, heads, headdim) ones with int32 offsets cum_seq_q / cum_seq_k, or None."""
    if cum_seq_q is None:
        if seqused_k is not None:
            return "seqused_k without cum_seq_q (flashtriton takes it for packed sequences)"
        return supported(q, k, v, names=_NAMES, softmax_scale=scale, window_size=window)
    for name, x in zip(_NAMES, (q, k, v)):
        if x.dim() != 3:
            return f"{name} must be 3-D (total, heads, headdim) with cum_seq_q; got {describe(x)}"
    numel = cum_seq_q.numel()
    reason = (_index_misfit("cum_seq_q", cum_seq_q, numel, q.device)
              or _index_misfit("cum_seq_k", cum_seq_k, numel, q.device)
              or (None if seqused_k is None
                  else _index_misfit("seqused_k", seqused_k, numel - 1, q.device)))
    if reason is not None:
        return reason
    return supported(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), names=_NAMES,
                     softmax_scale=scale, window_size=window)


def _forward(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
             return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
             seqused_k=None, alibi_slopes=None, **newer):
    """``_flash_attention_forward`` into ``out`` (None: a new tensor), or why not."""
    window = _window(window_size_left, window_size_right)
    reason = (_option_misfit(dropout_p, dict(return_debug_mask=return_debug_mask,
                                             alibi_slopes=alibi_slopes, **newer))
              or _misfit(query, key, value, cum_seq_q, cum_seq_k, scale, window, seqused_k))
    if reason is not None:
        return reason
    if out is not None and (out.shape[:-1] != query.shape[:-1] or out.shape[-1] != value.shape[-1]
                            or out.dtype != query.dtype or out.device != query.device
                            or out.stride(-1) != 1):
        return (f"out must have the query's shape with the value's head dim, its dtype and "
                f"device, and a unit stride on headdim; got {describe(out)}")
    with torch.no_grad():  # (aten's autograd kernel, above this one, records the graph)
        if cum_seq_q is None:
            res, lse = flash_attention_with_lse(query, key, value, causal=is_causal,
                                                softmax_scale=scale, window_size=window)
            if out is not None:
                res = out.copy_(res)
        else:
            res, lse = flash_attention_varlen_with_lse(
                query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, causal=is_causal,
                softmax_scale=scale, window_size=window, seqused_k=seqused_k, out=out)
    lse.masked_fill_(lse == float("-inf"), float("inf"))  # flash-attn's value: no key seen
    device = query.device
    return (res, lse, torch.zeros(2, dtype=torch.uint64, device=device),
            torch.zeros((), dtype=torch.uint64, device=device),
            torch.empty(0, dtype=query.dtype, device=device))


def flash_forward(*args, **kwargs):
    """aten::_flash_attention_forward: (out, lse, rng_state, unused, debug_attn_mask)."""
    return _forward(None, *args, **kwargs)


def flash_forward_inplace(out, *args, **kwargs):
    """aten::_flash_attention_forward_no_dropout_inplace: the output into ``out``; the LSE."""
    result = _forward(out, *args, **kwargs)
    return result if isinstance(result, str) else result[1]


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                   max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                   window_size_left=None, window_size_right=None, **newer):
    """aten::_flash_attention_backward: (dq, dk, dv)."""
    window = _window(window_size_left, window_size_right)
    reason = (_option_misfit(dropout_p, newer)
              or _misfit(query, key, value, cum_seq_q, cum_seq_k, scale, window))
    if reason is not None:
        return reason
    packed = cum_seq_q is not None
    return _run_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, window,
                         cum_seq_q, cum_seq_k, max_q if packed else 0, max_k if packed else 0)


def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                 scale=None):
    """aten::_scaled_dot_product_flash_attention on (batch, heads, seqlen, headdim) tensors:
    (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask),
    the offsets None."""
    if query.dim() != 4:
        return f"query must be 4-D (batch, heads, seqlen, headdim); got {describe(query)}"
    SQ, SK = query.shape[2], key.shape[2]
    result = flash_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           None, None, SQ, SK, dropout_p, is_causal, return_debug_mask,
                           scale=scale)
    if isinstance(result, str):
        return result
    out, lse, seed, offset, debug_mask = result
    return out.transpose(1, 2), lse, None, None, SQ, SK, seed, offset, debug_mask


def sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                  max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: (dq, dk, dv) in (batch, heads,
    seqlen, headdim)."""
    if query.dim() != 4:
        return f"query must be 4-D (batch, heads, seqlen, headdim); got {describe(query)}"
    grads = flash_backward(*(x.transpose(1, 2) for x in (grad_out, query, key, value, out)),
                           logsumexp, None, None, max_q, max_k, dropout_p, is_causal,
                           philox_seed, philox_offset, scale=scale)
    if isinstance(grads, str):
        return grads
    return tuple(g.transpose(1, 2) for g in grads)


# Each operator's implementation: its result, or why the kernels leave the call to torch's.
_KERNELS = {
    "_scaled_dot_product_flash_attention": sdpa_forward,
    "_scaled_dot_product_flash_attention_backward": sdpa_backward,
    "_flash_attention_forward": flash_forward,
    "_flash_attention_backward": flash_backward,
    "_flash_attention_forward_no_dropout_inplace": flash_forward_inplace,
}
