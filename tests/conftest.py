import os

# Float32 tests mean float32 on every backend. MLX runs float32 matmuls and
# attention at TF32 precision on CUDA unless MLX_ENABLE_TF32=0 (read at the
# first matmul, so set before any test imports mlx): on the H200 that moved
# the tests' float32 logits by 3e-4 to 2.1e-2 between two computations of the
# same values (a batch against each row alone, a routed read against the
# stock one); with it off the same comparisons differ by ~1e-5, as on the
# CPU (notes/testing.md, "Tests on CUDA"). An explicit setting is kept.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tiny_models as tm  # noqa: E402

# --- fixtures shared by several test files ------------------------------------------------
# The tiny models are built once per test module (scope="module"), as each file built its
# own; the real model once per test process (scope="session": a load costs seconds).
# A file that needs another model of the same name defines its own fixture, which
# overrides these (tests/core/test_handles.py's two-layer llama).


@pytest.fixture(scope="module")
def llama():
    """The tiny llama of ``tiny_models.llama_model()`` (3 layers, seed 0)."""
    return tm.llama_model()


@pytest.fixture(scope="module")
def gemma():
    """The tiny gemma3_text of ``tiny_models.gemma3_model()`` (4 layers, sliding window 8,
    sliding and full layers alternating: rings and dense records)."""
    return tm.gemma3_model()


@pytest.fixture(scope="session")
def smollm():
    """The real model (SmolLM2-135M-Instruct from its GGUF file, fetched and cached on first
    use), dequantized to float32; loaded once per test process (about 4 s of CPU a load),
    shared by every file that asks for it: no test changes its weights."""
    from kvstate.models import load as models

    return models.load_model(None, dequantize=True)


@pytest.fixture
def rng():
    """A fresh seeded numpy generator per test."""
    return np.random.default_rng(0)
