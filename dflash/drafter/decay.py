"""The loss decay over block positions, w_k = exp(-(k-1)/gamma): the paper's default gamma per
block size. Torch-free, so launch-time profile checks can ask it without importing torch."""
from __future__ import annotations

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int, configured: float = 0.0) -> float:
    """gamma = 7 / 5 / 4 for B = 16 / 10 / 8; other block sizes need train.decay_gamma."""
    if configured > 0:
        return configured
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(f"no default loss decay for block size {block_size} (defaults exist for "
                         f"{sorted(DEFAULT_GAMMA)}); set train.decay_gamma in the profile")
    return DEFAULT_GAMMA[block_size]
