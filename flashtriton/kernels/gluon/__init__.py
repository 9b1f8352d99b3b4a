"""The Gluon kernel family (Hopper, Triton 3.6; ``launch.gluon_attn`` launches them):

- ``fwd``: the warp-specialized forward (FlashAttention-3's layout, the softmax overlapping
  the P V product);
- ``bwd``: the warp-specialized backward (five products a block pair, dQ by TMA reductions);
- ``common``: what both use (the slots of their scalar tuples, ``grid_order``,
  ``store_rows``).

Their causal / window masks are ``kernels.mask.visible_by_row`` / ``visible_by_key``, beside
the Triton kernels' ``visible``. Gluon does not run in Triton's interpreter:
tools/compile_check.py compiles every variant for sm_90 on any machine.
"""
