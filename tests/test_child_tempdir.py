"""A child's own temporary folder (launcher_core.processes.child_tempdir): a supervised server and a
torchrun agent with what it starts write their temporary files there (TMPDIR), and the folder is
gone once they have ended; inductor's cache stays where it was. Real child processes: a small
stdlib HTTP server under ServerSupervisor, and a script with a child of its own under run_agent."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from launcher_core.processes import TEMPDIR_PREFIX, free_port, inductor_cache_dir

# Writes a file into its temporary folder, has a child write one too, records where, then (with
# `serve`) answers /health until stopped.
CHILD = r'''
import json, os, subprocess, sys, tempfile
record, mode = sys.argv[1], sys.argv[2]
with tempfile.NamedTemporaryFile("w", prefix="left-behind-", delete=False) as handle:
    handle.write("a file nobody removes")
subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp(prefix='grandchild-')"], check=True)
facts = {"tmp": tempfile.gettempdir(), "files": sorted(os.listdir(tempfile.gettempdir())),
         "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
with open(record + ".part", "w") as out:
    json.dump(facts, out)
os.replace(record + ".part", record)
if mode == "serve":
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(sys.argv[3])), Health).serve_forever()
'''


def child_script(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    return script


def assert_own_folder(facts: dict, kind: str) -> Path:
    """The child's temporary folder was a fresh `dflash-<kind>-*` one in the system's, holding what it and its
    child wrote; the compile cache was pointed where it was before."""
    folder = Path(facts["tmp"])
    assert folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith(f"{TEMPDIR_PREFIX}{kind}-"), facts
    assert any(name.startswith("left-behind-") for name in facts["files"]), facts
    assert any(name.startswith("grandchild-") for name in facts["files"]), facts
    assert facts["inductor"] == inductor_cache_dir() and not facts["inductor"].startswith(str(folder)), facts
    return folder


def test_a_supervised_server_and_its_children_write_to_a_folder_removed_when_it_stops(tmp_path):
    from dflash.generate.servers import ServerCommand, ServerSupervisor

    port, record = free_port(), tmp_path / "facts.json"
    command = ServerCommand([sys.executable, str(child_script(tmp_path)), str(record), "serve", str(port)], {},
                            f"http://127.0.0.1:{port}", "test server")
    supervisor = ServerSupervisor(command, tmp_path / "server.log", startup_timeout_s=60)
    supervisor.start()
    try:
        folder = assert_own_folder(json.loads(record.read_text()), "server")
        assert folder.is_dir()
    finally:
        supervisor.stop()
    assert not folder.exists()
    supervisor.start()           # a restart gets a new folder
    try:
        assert assert_own_folder(json.loads(record.read_text()), "server") != folder
    finally:
        supervisor.stop()


def test_the_agent_and_what_it_starts_write_to_a_folder_removed_after_them(tmp_path):
    from dflash.train.supervisor.launch import TrainPaths, run_agent

    paths, record = TrainPaths(tmp_path / "run"), tmp_path / "facts.json"
    paths.run_dir.mkdir(parents=True)
    lock_fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    try:
        end = run_agent([sys.executable, str(child_script(tmp_path)), str(record), "exit"], dict(os.environ), paths,
                        lock_fd, heartbeat_timeout_s=60)
    finally:
        os.close(lock_fd)
    assert end.code == 0
    folder = assert_own_folder(json.loads(record.read_text()), "train")
    assert not folder.exists()
