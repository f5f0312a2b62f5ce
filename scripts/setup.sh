#!/usr/bin/env bash
# Sets up .venv with everything the embedded CPU default and the tests need.
# Idempotent: reinstalls only when a requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
fi
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi

# The project's own bytecode, next to its sources (__pycache__ is ignored by git), on every core; up to
# date files are skipped. Where the environment sets PYTHONDONTWRITEBYTECODE, no process writes it
# otherwise, and every rank, server and CLI process of a run compiled the modules it imports again
# (about 0.2 CPU-s a training rank: BENCHMARKS.md "The test suite's time"). A file edited later is
# compiled in memory as before.
compile_project() {
  .venv/bin/python -m compileall -q -j 0 launcher.py dflash envcheck launcher_core tests benchmarks scripts >/dev/null
}

stamp=.venv/.requirements.sha256
wanted=$(cat requirements-cpu.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  compile_project
  exit 0
fi
echo "setup: installing requirements into .venv (first run takes a few minutes)" >&2
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -r requirements-cpu.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile --no-deps -r requirements-nodeps.txt
# Bytecode compiled on every core at once: pip compiles on one (on 2 cores the install took 67 s, 41 s this
# way). The packages' own test suites (pandas, sympy, numpy, torch, networkx, pyarrow, matplotlib: 40 MB of
# the 246 MB of source) are left out: nothing imports them; a fifth of the compile time. A few files that
# are not valid under this Python (pip skips them too) make compileall exit 1.
site_packages=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
.venv/bin/python -m compileall -q -j 0 -x '/tests?/' "$site_packages" >/dev/null || true
compile_project
echo "$wanted" > "$stamp"
