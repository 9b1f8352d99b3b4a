"""The KV-cache launcher's remembered calls: the records that replay a call's launches on new
tensors of the same signature, the signature of a plain decoding step, and the per-stream
workspace of the split kernel's in-kernel merge. ``launch.decode`` launches and makes the
records; ``flashtriton.decode`` replays a plain step (``step_signature``, ``replay_step``)
before it checks anything.

A remembered call is one record, by the way its splits are merged: ``OneSplit``,
``MergeKernel``, ``MergedInKernel`` or ``PrefillRoute``; each holds its launches' Replays and
``replay(tensors, out, lse)`` launches them on new tensors of the same signature. A dense call
on the split route (``launch.decode.dense_split``) is remembered under attention_forward's
signature as a ``DenseSplit``, called on the forward's pointers as the forward's own replays
are.
"""

from typing import NamedTuple, Optional

import torch

from .. import configs, runtime
from .calls import AttentionOutput

# The split kernel's counts and partials live in a workspace per (device, stream): steps on
# one stream run in order.
_COUNTS = 4096  # counters at a workspace's head: one per (sequence, KV head) of a launch
_WORKSPACES = {}  # (device index, stream) -> (workspace, its fp32 elements, its address)
_WORKSPACES_MAX = 64  # more streams start over (torch reuses a freed block in its stream's order)


def _eager(q: torch.Tensor) -> bool:
    """Not under a CUDA graph's capture (whose replays may run on several streams at once)."""
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _workspace(x: torch.Tensor, elements: int) -> tuple:
    """The workspace of x's device's current stream, with room for ``elements`` fp32 partials
    after its counters (zero between steps: the split that merges sets its count back)."""
    index = x.get_device()  # -1: the CPU (the interpreter), whose steps run in order
    key = (index, runtime.driver.active.get_current_stream(index) if index >= 0 else 0)
    entry = _WORKSPACES.get(key)
    if entry is None or entry[1] < _COUNTS + elements:
        if entry is None and len(_WORKSPACES) >= _WORKSPACES_MAX:
            _WORKSPACES.clear()
        buf = torch.zeros(_COUNTS + elements, dtype=torch.float32, device=x.device)
        entry = _WORKSPACES[key] = (buf, buf.numel(), buf.data_ptr())
    return entry


# A remembered call: one record per way its splits are merged. ``tensors`` are the call's
# leading tensors (q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, cache_leftpad,
# alibi, sinks, k_descale, v_descale), out and lse its new outputs; replay returns False
# where one is not 16-byte aligned (nothing launched). lse_always: the record writes an LSE
# even without return_lse.

def _replay_launches(record, tensors, out, lse) -> bool:
    """The replay of a record whose ``launch(lead, out, lse, device)`` takes the pointers of
    its leading tensors, out and lse (OneSplit, MergeKernel)."""
    ptrs = runtime.pointers(*tensors, out, lse)
    if ptrs is None:
        return False
    record.launch(ptrs[:-2], ptrs[-2], ptrs[-1], out.device)
    return True


class OneSplit(NamedTuple):
    """One split: the split kernel writes the output and its LSE (or None) itself."""
    run_decode: runtime.Replay
    mode = "one"
    lse_always = False
    replay = _replay_launches

    def launch(self, lead, out, lse, device) -> None:
        """The launches on the pointers of the leading tensors, out and lse."""
        self.run_decode(*lead, out, lse)


class MergeKernel(NamedTuple):
    """Splits into fp32 partials (one allocation of ``size`` elements, the LSEs from
    ``lse_at``: launch.decode._partials_layout), then the merge kernel into the output."""
    run_decode: runtime.Replay
    run_merge: runtime.Replay
    size: int
    lse_at: int
    mode = "merge"
    lse_always = False
    replay = _replay_launches

    def launch(self, lead, out, lse, device) -> None:
        """The launches on the pointers of the leading tensors, out and lse; the partials as
        one new allocation (512-byte aligned: torch's allocator), passed as two addresses
        (see launch.decode._partials)."""
        partials = torch.empty(self.size, dtype=torch.float32, device=device)
        o_part = partials.data_ptr()
        lse_part = o_part + 4 * self.lse_at
        self.run_decode(*lead, o_part, lse_part)
        self.run_merge(o_part, lse_part, out, lse, lead[8])  # (8: the sinks)


class MergedInKernel(NamedTuple):
    """Splits merged in the split kernel: its partials (``size``, ``lse_at`` as MergeKernel's)
    and counts in the stream's workspace, the output and LSE its merge's."""
    run_decode: runtime.Replay
    size: int
    lse_at: int
    mode = "in-kernel"
    lse_always = False

    def replay(self, tensors, out, lse) -> bool:
        ptrs = runtime.pointers(*tensors, out, lse)
        if ptrs is None:
            return False
        counts = _workspace(out, self.size)[2]  # 512-byte aligned (torch's allocator)
        o_part = counts + 4 * _COUNTS
        self.run_decode(*ptrs[:-2], o_part, o_part + 4 * self.lse_at, *ptrs[-2:], counts)
        return True


class PrefillRoute(NamedTuple):
    """The prefill route (launch.decode._prefill): the spans kernel, then the forward over
    packed views; ``seg`` int32s per part of the spans. It always writes an LSE."""
    run_spans: runtime.Replay
    run_fwd: runtime.Replay
    seg: int
    mode = "prefill"
    lse_always = True

    def replay(self, tensors, out, lse) -> bool:
        q, k_cache, v_cache, seqlens, _, cache_batch_idx, cache_leftpad, _, sinks = tensors[:9]
        seg = self.seg
        spans = torch.empty(3 * seg, dtype=torch.int32, device=out.device)
        ptrs = runtime.pointers(q, k_cache, v_cache, out, lse, seqlens, cache_batch_idx,
                                cache_leftpad, spans, sinks)
        if ptrs is None:
            return False
        self.run_spans(*ptrs[5:9])
        self.run_fwd(*ptrs[:5], None, None, ptrs[8], ptrs[8] + 4 * seg, ptrs[8] + 8 * seg,
                     None, ptrs[9])  # (the forward's block mask, then its sinks)
        return True


class DenseSplit(NamedTuple):
    """A dense call's split route (launch.decode.dense_split: a OneSplit or MergeKernel
    ``record`` whose key counts are the cache's length, no tensor), remembered under
    attention_forward's signature and called as the forward's replays are: on the pointers of
    q, k, v, out, lse and the forward's ALiBi, block mask and sinks, None in a remembered
    call."""
    record: NamedTuple
    device: torch.device

    def __call__(self, q, k, v, out, lse, *_) -> None:
        self.record.launch((q, k, v, None, None, None, None, None, None, None, None), out, lse,
                           self.device)


def _remember(signature, record, dense=None) -> None:
    """Remember a call's record under its signature, if each of its launches replays; a dense
    call's (dense_split, on ``dense``, its device) as a DenseSplit."""
    if None not in record:
        runtime.remember(signature, record if dense is None else DenseSplit(record, dense))


def remembered(signature):
    """The record remembered under ``signature`` (OneSplit, MergeKernel, MergedInKernel or
    PrefillRoute), or None."""
    known = runtime.recall(signature)
    if known is None:
        return None
    (record,) = known
    return record


def step_signature(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_batch_idx=None,
                   cache_leftpad=None, alibi_slopes=None, softmax_scale=None, causal=False,
                   window_size=(-1, -1), softcap=0.0, num_splits=0, return_lse=True,
                   sinks=None, batch_invariant=False, k_descale=None, v_descale=None):
    """What a plain step of attention_with_kvcache with these arguments is remembered under
    (``remembered`` of it: the step's record; the tools in tools/ read them)."""
    return runtime.call_signature(
        "decode-step", (softmax_scale, causal, window_size, softcap, num_splits, return_lse,
                        configs.DECODE_MERGE_IN_KERNEL and _eager(q), batch_invariant), q,
        k_cache, v_cache, cache_seqlens,
        block_table, cache_batch_idx, cache_leftpad, alibi_slopes, sinks, k_descale, v_descale)


def replay_step(signature, tensors, return_lse) -> Optional[AttentionOutput]:
    """A plain step's remembered launches on its tensors (q first), into new outputs; None
    where nothing is remembered under ``signature`` or a tensor is not 16-byte aligned."""
    record = remembered(signature)
    if record is None:
        return None
    q = tensors[0]
    B, SQ, H, _ = q.shape
    out = runtime._empty(q.shape, q.dtype, q.device)
    lse = (runtime._empty((B, H, SQ), torch.float32, q.device)
           if return_lse or record.lse_always else None)
    if record.replay(tensors, out, lse):
        return AttentionOutput(out, lse if return_lse else None)
    return None
