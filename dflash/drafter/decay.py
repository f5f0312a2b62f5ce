"""The loss decay over block positions, w_k = exp(-(k-1)/gamma): the paper's default gamma per
block size. Torch-free, so launch-time profile checks can ask it without importing torch."""
from __future__ import annotations

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def has_default_gamma(block_size: int) -> bool:
    """Whether the paper gives a gamma for this block size (otherwise train.decay_gamma must be set:
    the launch checks, dflash.train.supervisor.launch_checks, say so)."""
    return block_size in DEFAULT_GAMMA


def default_gamma(block_size: int, configured: float = 0.0) -> float:
    """`configured` when set (> 0), else gamma = 7 / 5 / 4 for B = 16 / 10 / 8."""
    if configured > 0:
        return configured
    assert has_default_gamma(block_size), "the launch checks hold train.decay_gamma"
    return DEFAULT_GAMMA[block_size]
