"""The launcher asks NCCL's monitor thread for its flight recorder through the rank's dump pipe before it stops a
stuck run (dflash.train.supervisor.watchdog.ask_nccl_dump). The pipe is what ProcessGroupNCCL makes at
TORCH_NCCL_DEBUG_INFO_PIPE_FILE: a FIFO `<stem><rank>.pipe` it opens O_RDONLY | O_NONBLOCK and reads about once a
second (`DumpPipe`); a real FIFO opened that way stands in for the monitor thread here, which no CPU can run."""
from __future__ import annotations

import os
import time

from dflash.train.rank.parallel import make_nccl_dump_folders
from dflash.train.supervisor.heartbeat import nccl_dump_pipe, nccl_dump_pipe_stem
from dflash.train.supervisor.watchdog import ask_nccl_dump


def test_a_rank_reading_its_dump_pipe_gets_the_request(tmp_path):
    make_nccl_dump_folders({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(nccl_dump_pipe_stem(tmp_path))})
    pipe = nccl_dump_pipe(tmp_path, 3)
    assert pipe.name == "nccl-dump-rank-3.pipe" and pipe.parent.is_dir()
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)          # as ProcessGroupNCCL's DumpPipe opens it
    try:
        assert ask_nccl_dump(tmp_path, 3)
        assert os.read(reader, 64)                              # what its shouldDump() reads
    finally:
        os.close(reader)


def test_no_reader_no_pipe_or_a_plain_file_is_no_request_and_never_blocks(tmp_path):
    make_nccl_dump_folders({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(nccl_dump_pipe_stem(tmp_path))})
    assert not ask_nccl_dump(tmp_path, 0)                       # a gloo rank: no pipe
    os.mkfifo(nccl_dump_pipe(tmp_path, 1))
    started = time.monotonic()
    assert not ask_nccl_dump(tmp_path, 1)                       # its process group has not started: nobody reads
    assert time.monotonic() - started < 1.0
    nccl_dump_pipe(tmp_path, 2).write_text("not a pipe")
    assert not ask_nccl_dump(tmp_path, 2) and nccl_dump_pipe(tmp_path, 2).read_text() == "not a pipe"
