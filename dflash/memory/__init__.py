"""GPU memory: the analytic model of a training step's peak, the per-rank plan (budgets and
the agreed micro-batch) and calibration from measured peaks."""
