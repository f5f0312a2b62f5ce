"""The launcher's one training progress bar, following rank 0's train/progress.json."""
from __future__ import annotations

import io
import time

from dflash.train.supervisor.progress import ProgressBar, TrainProgress, read_progress, write_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def report_steps(train_dir, steps: range, total: int, pause_s: float) -> None:
    for step in steps:
        write_progress(train_dir, TrainProgress(step, total, loss=3.0 - step / 10, sim_tau=1.0 + step / 100))
        time.sleep(pause_s)


def test_a_log_file_gets_plain_lines_not_one_line_per_step(tmp_path):
    log = io.StringIO()
    with ProgressBar(tmp_path, stream=log, poll_s=0.01, log_interval_s=0.1):
        report_steps(tmp_path, range(1, 41), total=40, pause_s=0.01)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert 2 <= len(lines) < 20                                     # throttled, not 40 lines
    assert lines[-1] == "train: step 40/40 (100%), loss=-1.000, tau=1.40"
    assert all(line.startswith("train: step ") for line in lines)


def test_a_terminal_gets_one_bar_redrawn_in_place(tmp_path):
    screen = Terminal()
    with ProgressBar(tmp_path, stream=screen, poll_s=0.01):
        report_steps(tmp_path, range(1, 21), total=20, pause_s=0.02)
    drawn = screen.getvalue()
    assert drawn.count("\n") <= 1 and "\r" in drawn                 # one line, redrawn with carriage returns
    assert "20/20" in drawn.rsplit("\r", 1)[-1] and "loss=1.000" in drawn


def test_a_new_run_does_not_show_the_last_runs_progress(tmp_path):
    write_progress(tmp_path, TrainProgress(650, 650, 2.0, 1.3))
    log = io.StringIO()
    with ProgressBar(tmp_path, stream=log, poll_s=0.01):
        time.sleep(0.05)
    assert log.getvalue() == "" and read_progress(tmp_path) is None
