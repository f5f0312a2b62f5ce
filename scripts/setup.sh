#!/usr/bin/env bash
# Sets up .venv with everything the embedded CPU default and the tests need.
# Idempotent: reinstalls only when a requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# The interpreter of a new .venv: $PYTHON when set; else the distribution's Python 3.11 where it has
# venv (Debian/Ubuntu: python3.11-venv); else python3.11 on PATH; else python3. A distribution builds
# CPython with profile-guided optimisation and LTO and links the interpreter statically; a Python built
# from source with pyenv's defaults has neither (no --enable-optimizations, libpython shared). Measured on a
# machine with both: a training rank's imports 0.81x the CPU with the distribution's, the whole test suite
# about 15 % less machine CPU (benchmarks/results/interpreters_cpu-2core_2026-12-06.md).
# An existing .venv keeps the interpreter it was made with.
distribution_python=/usr/bin/python3.11
choose_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if [ -x "$distribution_python" ] && "$distribution_python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    echo "$distribution_python"; return
  fi
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; else echo python3; fi
}
if [ ! -x .venv/bin/python ]; then
  python_bin=$(choose_python)
  echo "setup: creating .venv with $python_bin ($("$python_bin" -c 'import sys; print(sys.version.split()[0])'))" >&2
  "$python_bin" -m venv .venv
fi

# The project's own bytecode, next to its sources (__pycache__ is ignored by git), on every core; up to
# date files are skipped. Where the environment sets PYTHONDONTWRITEBYTECODE, no process writes it
# otherwise, and every rank, server and CLI process of a run compiled the modules it imports again
# (about 0.2 CPU-s a training rank: benchmarks/results/test-suite-cpu_cpu-2core_2026-12-05.md). A file edited later is
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
# uv installs the pins (3-7 s where pip took 21 s on 2 cores), with the local wheels pip's find-links hold;
# pip where uv cannot (scripts/install_requirements.py says why).
.venv/bin/python scripts/install_requirements.py requirements-cpu.txt requirements-nodeps.txt
# Bytecode compiled on every core at once: pip compiles on one (on 2 cores the install took 67 s, 41 s this
# way). The packages' own test suites (pandas, sympy, numpy, torch, networkx, pyarrow, matplotlib: 40 MB of
# the 246 MB of source) are left out: nothing imports them; a fifth of the compile time. A few files that
# are not valid under this Python (pip skips them too) make compileall exit 1.
site_packages=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
.venv/bin/python -m compileall -q -j 0 -x '/tests?/' "$site_packages" >/dev/null || true
compile_project
echo "$wanted" > "$stamp"
