"""One live training progress bar, drawn by the launcher, not by the ranks.

Under torchrun every line a rank prints goes through the agent's tee, which prefixes it
(`[default0]:`) and breaks a carriage-return bar into one line per update. So rank 0 only writes
its progress to `train/progress.json` (atomically, every step) and the launcher process, which
owns the terminal, shows one bar from it: a live line in a terminal, a line every
`LOG_INTERVAL_S` seconds when its stderr is a log file.
"""
from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

PROGRESS_FILE = "progress.json"
POLL_S = 0.5
LOG_INTERVAL_S = 30.0


@dataclass(frozen=True)
class TrainProgress:
    """What rank 0 reports after each optimizer step."""

    step: int
    total_steps: int
    loss: float
    sim_tau: float                      # on the training batch: accepted + 1 per block, as eval counts tau
    val_tau: Optional[float] = None     # the last held-out tau (train.validation_share), None before one

    def postfix(self) -> str:
        held_out = "" if self.val_tau is None else f", held-out tau={self.val_tau:.2f}"
        return f"loss={self.loss:.3f}, tau={self.sim_tau:.2f}{held_out}"


def write_progress(train_dir: Path, progress: TrainProgress) -> None:
    from launcher_core.fileio import write_json_atomic

    write_json_atomic(train_dir / PROGRESS_FILE, asdict(progress))


def read_progress(train_dir: Path) -> Optional[TrainProgress]:
    """The last step rank 0 reported; None before the first (or a file from another version)."""
    try:
        return TrainProgress(**json.loads((train_dir / PROGRESS_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


class ProgressBar:
    """While open, a thread follows `train_dir/progress.json` and shows it on `stream`: one tqdm bar
    redrawn in place in a terminal; in a log file, a plain line every `log_interval_s` seconds (and
    the last step), which reads well in `less` and `tail -f`."""

    def __init__(self, train_dir: Path, stream: TextIO | None = None, poll_s: float = POLL_S,
                 log_interval_s: float = LOG_INTERVAL_S):
        self.train_dir, self.poll_s, self.log_interval_s = train_dir, poll_s, log_interval_s
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="train-progress", daemon=True)
        self._bar: Any = None
        self._logged: tuple[int, float] = (-1, 0.0)     # (step, time) of the last log line

    def __enter__(self) -> "ProgressBar":
        (self.train_dir / PROGRESS_FILE).unlink(missing_ok=True)   # a bar of this run, not the last one's
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._show(read_progress(self.train_dir), final=True)
        if self._bar is not None:
            self._bar.close()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._show(read_progress(self.train_dir))

    def _show(self, progress: Optional[TrainProgress], final: bool = False) -> None:
        if progress is None:
            return
        if self.live:
            self._draw(progress)
        else:
            self._log(progress, final)

    def _draw(self, progress: TrainProgress) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=progress.total_steps, initial=max(0, progress.step - 1), desc="train",
                             unit="step", file=self.stream, dynamic_ncols=True, mininterval=0.5)
        self._bar.total = progress.total_steps
        self._bar.set_postfix_str(progress.postfix(), refresh=False)
        self._bar.update(progress.step - self._bar.n)

    def _log(self, progress: TrainProgress, final: bool) -> None:
        import time

        last_step, last_time = self._logged
        now = time.monotonic()
        due = now - last_time >= self.log_interval_s or (final or progress.step == progress.total_steps)
        if progress.step == last_step or not due:
            return
        share = 100.0 * progress.step / max(1, progress.total_steps)
        self.stream.write(f"train: step {progress.step}/{progress.total_steps} ({share:.0f}%), {progress.postfix()}\n")
        self.stream.flush()
        self._logged = (progress.step, now)
