"""The tests' tolerances for two computations of the same values, by dtype, in one place.

Two such computations (a batch and each row alone, a routed read and the
stock one, a compiled step and an eager one) differ only by the order of
their sums. The test session runs float32 at full precision on every backend
(``conftest.py`` sets ``MLX_ENABLE_TF32=0``: MLX's CUDA backend would
otherwise run float32 matmuls and attention in TF32), so a float32 tolerance
is one number everywhere: the largest gap measured between such logits is
about 5e-6 on the CPU and 1.4e-5 on the H200 (test_compiled's gemma3 rings,
14 steps, logits up to ~5). A wrong or missing column moves them
by 1e-2 and more.
"""

import mlx.core as mx

_ATOL = {mx.float32: 2e-5}  # absolute, on logits and attention outputs
_REL_L2 = {mx.bfloat16: 3e-2}  # relative L2 error against a float32 reference


def atol(dtype=mx.float32) -> float:
    """The absolute tolerance between two computations in ``dtype``."""
    return _ATOL[dtype]


def rel_l2(dtype) -> float:
    """The relative L2 tolerance of a ``dtype`` computation against float32."""
    return _REL_L2[dtype]
