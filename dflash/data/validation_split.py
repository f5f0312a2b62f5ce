"""Which rows of a dataset `train.validation_share` holds out of training: how many (`held_out_count`, which
the launcher also counts a run's steps with) and which (`split_rows`: chosen once from the row count and
train.seed, the same on every rank and every restart; each rank's data splits its dataset with it)."""
from __future__ import annotations

from dataclasses import dataclass, field

VALIDATION_STREAM = 7_417      # the random stream of the validation split (apart from the epochs' orders)


@dataclass(frozen=True)
class RowSplit:
    """Dataset rows that train and rows held out for validation (both sorted)."""

    train: tuple[int, ...]
    validation: tuple[int, ...] = field(default=())


def held_out_count(rows: int, share: float) -> int:
    """Rows train.validation_share holds out of `rows`: round(share x rows), at least one when share > 0
    (`split_rows` chooses which)."""
    return min(rows, max(1, round(share * rows))) if share > 0 else 0


def split_rows(count: int, share: float, seed: int) -> RowSplit:
    """Hold out round(share x count) rows (at least one when share > 0), chosen at random from
    `seed`; every caller with the same count, share and seed gets the same split."""
    import numpy as np

    held = held_out_count(count, share)
    if not held:
        return RowSplit(tuple(range(count)))
    order = np.random.default_rng([seed, VALIDATION_STREAM]).permutation(count)
    return RowSplit(tuple(sorted(int(row) for row in order[held:])), tuple(sorted(int(row) for row in order[:held])))
