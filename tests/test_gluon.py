"""The experimental Gluon forward (kernels.gluon_fwd, Hopper only) against the float64
reference. Its compiled sm_90 code (the softmax between the two products' waits, the point of
the kernel) is checked on any machine by scripts/compile_check.py, which CI runs."""

import pytest
import torch

from accuracy import check_against_reference, make_qkv
from conftest import ON_GPU

HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("B,N,H,HKV,D", [(2, 1000, 3, 3, 128), (1, 4096, 2, 2, 128),
                                         (2, 777, 2, 2, 64), (1, 128, 1, 1, 128),
                                         (1, 100, 2, 2, 64), (2, 600, 8, 2, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("ws", [False, True], ids=["plain", "warp-specialized"])
def test_gluon_forward_matches_reference(B, N, H, HKV, D, causal, dtype, ws):
    from flashtriton.launch import attention_forward_gluon
    q, k, v = make_qkv(B, N, N, H, HKV, D, dtype, "cuda", requires_grad=False)
    check_against_reference(
        lambda q, k, v: attention_forward_gluon(q, k, v, causal, warp_specialize=ws), q, k, v,
        causal, check_grads=False)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_gluon_forward_rejects_what_it_does_not_take():
    from flashtriton.launch import attention_forward_gluon
    q, k, v = make_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    with pytest.raises(ValueError, match="HKV dividing H"):
        attention_forward_gluon(q, k[:, :32], v[:, :32])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        attention_forward_gluon(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="softmax_scale > 0"):
        attention_forward_gluon(q, k, v, softmax_scale=-0.1)
    with pytest.raises(ValueError, match="contiguous"):
        attention_forward_gluon(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)

