"""The drafter, extraction and speculative-decoding tests under each transformers version the GPU
requirement files pin (5.3.0 in requirements-cu128.txt, 5.12.1 in requirements-cu130.txt), in
scratch venvs built with uv (compat_venvs.py), with the CPU torch of this run. A version older
than the supported floor is refused with a message naming it.

Marked `compat` (and `slow`): `.ci/run` runs it as part of the suite (`pytest -m compat tests`
alone). Time on the 2-core machine: 5-20 s to build each venv (uv links torch from its cache; the
first build downloads transformers and its dependencies), nothing when an unchanged venv is
reused, and 1-3.5 minutes of tests per version (depending on load): 4-9 minutes in all.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from compat_venvs import REPO_ROOT, ensure_venv, local_torch_wheel, read_pin, run_in, transformers_venv

pytestmark = [pytest.mark.compat, pytest.mark.slow]

GPU_REQUIREMENTS = ("requirements-cu128.txt", "requirements-cu130.txt")
PINNED = sorted({read_pin(REPO_ROOT / name, "transformers") for name in GPU_REQUIREMENTS})
UNSUPPORTED = "5.2.0"             # the newest release below dflash.compat.MIN_TRANSFORMERS
TESTS = ["tests/eval/test_specdec.py", "tests/eval/test_twin_target.py", "tests/train/test_drafter.py"]
# What runs under each pin is every test that calls the transformers APIs the drafter, the extraction and
# speculative decoding use (the cache and its rollback, the cache keyword, logits_to_keep, hidden states,
# generate, from_pretrained's dtype and device_map, the Qwen3 modules the drafter is built of); deselected:
# - statistical and SmolLM2 tests (rejection sampling, chi-square, prompt lookup): they do not depend on the
#   transformers version (and take minutes);
# - flex vs sdpa: the drafter's two attention kernels are torch's, and the scratch venvs hold this run's torch;
#   the suite's own run covers it;
# - of the greedy losslessness sweep, wrong_every 0 (every draft right, nothing rolled back): under each pin
#   test_always_right_drafter_gets_tau_block_size decodes full acceptance on both targets at block sizes 2, 4
#   and 8; wrong_every 1 (the whole draft rolled back each step): test_always_wrong_drafter_gets_tau_one and the
#   rollback modes of test_twin_target.py (wrong every 1, 2 and 5); and block sizes 4 and 16: the sweep keeps
#   wrong_every 3 at block 2 (one draft token) and 7 (a rejection inside the block, the last block cut short),
#   where the same caches are cropped or restored by a whole and by a part of the draft. The suite's own run
#   keeps the whole sweep.
DESELECT = ("not rejection_sampling and not chi_square and not prompt_lookup and not flex_and_sdpa"
            " and not (greedy_output_equals_target_greedy and not -3-2 and not -3-7)")


@pytest.fixture(scope="module")
def venv_root() -> Path:
    from launcher_core.paths import cache_dir

    wheel = local_torch_wheel()
    if wheel is None:
        pytest.skip("no local wheel of this run's torch in pip's find-links; the scratch venvs take torch "
                    "from that same wheel and never download another build")
    return cache_dir() / "compat"


def test_the_gpu_pins_name_the_versions_under_test():
    assert PINNED == ["5.12.1", "5.3.0"], "a GPU requirements file changed its transformers: update this test's docstring"


@pytest.mark.parametrize("version", PINNED)
def test_drafter_extraction_and_specdec_tests_pass_under_the_gpu_pins(venv_root, version):
    venv = ensure_venv(transformers_venv(version, local_torch_wheel()), venv_root)
    installed = run_in(venv, ["-c", "from importlib.metadata import version; print(version('transformers'))"], 120)
    assert installed.stdout.split()[0] == version, installed.stdout + installed.stderr
    done = run_in(venv, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra --timeout=600", *TESTS,
                       "-k", DESELECT], 1500)     # the scratch venv has no pytest-xdist: not the suite's -n
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"transformers {version}: venv built in {venv.build_s} s (0: reused); {summary}")
    assert done.returncode == 0, f"transformers {version}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert re.search(r"\d+ passed", summary) and "failed" not in summary


def test_an_unsupported_transformers_is_refused_naming_it(venv_root):
    venv = ensure_venv(transformers_venv(UNSUPPORTED, local_torch_wheel()), venv_root)
    code = ("from dflash.eval.specdec import TargetVerifier\n"
            "from launcher_core.errors import ConfigError\n"
            "try:\n    TargetVerifier(object())\nexcept ConfigError as error:\n    print('REFUSED', error)\n")
    done = run_in(venv, ["-c", code], 300)
    assert f"REFUSED transformers {UNSUPPORTED} is not supported" in done.stdout, done.stdout + done.stderr
