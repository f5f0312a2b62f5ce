"""PNG plots (matplotlib, headless): training curves and the eval's acceptance figures.

* `training.png`: loss and acceptance length tau over steps, from metrics.jsonl: on the training
  batches (`loss`, `sim_tau`) and, with train.validation_share, on the held-out rows beside them
  (`val_loss`, `val_tau`, the best step marked). tau is accepted draft tokens + 1 per block, as eval
  counts it.
* `tau_histogram.png`: share of draft steps with tau = 1..B, one bar group per drafting method.
* `position_acceptance.png`: acceptance at each block position, one line per drafting method.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from launcher_core.errors import InputError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from dflash.eval.report_schema import EvalReport


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: str | Path) -> list[dict[str, object]]:
    """metrics.jsonl lines that carry a step; a torn last line (crash mid-write) is skipped."""
    rows = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise InputError(f"{path}: line {number}: not valid JSON") from None
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def _save(figure: Figure, path: Path) -> Path:
    import io

    from launcher_core.fileio import write_bytes_atomic

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(figure)
    return write_bytes_atomic(path, buffer.getvalue())


def plot_training(metrics: list[dict[str, object]], path: str | Path) -> Path:
    plt = _pyplot()
    figure, (loss_axis, tau_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    metrics = [row for row in metrics if not row.get("skipped")]       # a skipped step trained nothing: no loss
    steps = [row["step"] for row in metrics]
    loss_axis.plot(steps, [row.get("loss") for row in metrics], color="tab:red", label="training batches")
    tau_axis.plot(steps, [row.get("sim_tau") for row in metrics], color="tab:blue", label="training batches (estimate)")
    held_steps, held_losses, taus = held_out_series(metrics)
    if held_steps:
        loss_axis.plot(held_steps, held_losses, color="tab:orange", marker="o", label="held-out rows")
        tau_axis.plot(held_steps, taus, color="tab:green", marker="o", label="held-out rows")
        # the trainer's rule (dflash.train.rank.validation): highest tau, then lower loss, then the earlier step
        best = max(range(len(taus)), key=lambda i: (taus[i], -held_losses[i], -held_steps[i]))
        tau_axis.annotate(f"best {taus[best]:.3f} (step {held_steps[best]})", (held_steps[best], taus[best]),
                          textcoords="offset points", xytext=(-60, 8), fontsize=8)
    loss_axis.set(title="loss", xlabel="step", ylabel="loss")
    tau_axis.set(title="acceptance length (accepted + 1 per block)", xlabel="step", ylabel="tau")
    for axis in (loss_axis, tau_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return _save(figure, Path(path))


def held_out_series(metrics: list[dict[str, object]]) -> tuple[list[int], list[float], list[float]]:
    """(steps, held-out loss, held-out tau) of the metrics lines that carry a validation (train.validation_share)."""
    rows = [row for row in metrics if _number(row.get("val_tau")) is not None and _number(row.get("val_loss")) is not None]
    return ([int(_number(row["step"]) or 0) for row in rows], [_number(row["val_loss"]) or 0.0 for row in rows],
            [_number(row["val_tau"]) or 0.0 for row in rows])


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def plot_tau_histogram(report: EvalReport, path: str | Path) -> Path:
    plt = _pyplot()
    block = report.block_size
    drafted = report.drafted()
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    width = 0.8 / max(1, len(drafted))
    for i, (name, method) in enumerate(drafted.items()):
        histogram = method.tau_histogram or {}
        counts = [histogram.get(str(t), 0) for t in range(1, block + 1)]
        total = max(1, sum(counts))
        axis.bar([t + (i - (len(drafted) - 1) / 2) * width for t in range(1, block + 1)],
                 [c / total for c in counts], width=width, label=f"{name} (mean {method.mean_tau or 0:.2f})")
    axis.set(title="acceptance length per step", xlabel="tau", ylabel="share of steps", xticks=range(1, block + 1))
    axis.legend()
    return _save(figure, Path(path))


def plot_position_acceptance(report: EvalReport, path: str | Path) -> Path:
    plt = _pyplot()
    block = report.block_size
    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    for name, method in report.drafted().items():
        if method.position_acceptance is not None:
            axis.plot(range(1, block), method.position_acceptance, marker="o", label=name)
    axis.set(title="acceptance per block position", xlabel="block position", ylabel="accepted share",
             ylim=(0, 1.02), xticks=range(1, block))
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, Path(path))


def write_plots(report: EvalReport, eval_dir: str | Path, metrics_path: str | Path | None) -> list[Path]:
    """All plots into `eval_dir`; the training plot only when metrics exist."""
    eval_dir = Path(eval_dir)
    written = [plot_tau_histogram(report, eval_dir / "tau_histogram.png"),
               plot_position_acceptance(report, eval_dir / "position_acceptance.png")]
    if metrics_path is not None and Path(metrics_path).exists():
        metrics = read_metrics(metrics_path)
        if metrics:
            written.append(plot_training(metrics, eval_dir / "training.png"))
    return written
