"""The CLI surface: help is instant and light, errors map to exit codes in one place."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import launcher


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launcher.py", *args], capture_output=True, text=True,
                          cwd=launcher.__file__.rsplit("/", 1)[0], timeout=120, **kwargs)


def test_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in launcher.COMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("command", ["--help", "profiles", "plan --profile cpu-demo"])
def test_light_commands_do_not_import_torch(command):
    code = ("import sys, launcher; rc = launcher.main(sys.argv[1:]);"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import';"
            "sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, *command.split()], capture_output=True, text=True,
                            cwd=launcher.__file__.rsplit("/", 1)[0], timeout=120)
    assert result.returncode == 0, result.stderr


def test_unknown_profile_is_a_usage_error_naming_the_choices():
    result = run_cli("plan", "--profile", "nope")
    assert result.returncode == 2
    assert "unknown profile 'nope'" in result.stderr and "rtx6000-x8" in result.stderr


def test_every_registered_command_has_its_module_and_help(capsys):
    import importlib

    for name, (module_name, _) in launcher.COMMANDS.items():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), name
        with pytest.raises(SystemExit) as info:
            launcher.main([name, "--help"])
        assert info.value.code == 0, name
        assert "usage: launcher.py " + name in capsys.readouterr().out


@pytest.mark.parametrize("error, line", [
    (KeyboardInterrupt(), "interrupted"),
    ("interrupted", "interrupted: training stopped by SIGINT after step 7; checkpoint step-7 saved."),
])
def test_an_interruption_is_exit_130_and_says_what_was_kept(monkeypatch, capsys, error, line):
    """Ctrl-C anywhere is 130; a run that stopped on it (launcher_core.errors.Interrupted) says how to go on."""
    from dflash.commands import profiles
    from launcher_core.errors import Interrupted

    def run(_args):
        raise Interrupted(line.removeprefix("interrupted: ")) if error == "interrupted" else error

    monkeypatch.setattr(profiles, "run", run)
    assert launcher.main(["profiles"]) == 130
    assert capsys.readouterr().err.strip() == line


def test_a_broken_profile_file_is_named_and_the_good_ones_still_listed(tmp_path):
    """One file in profiles/ that does not load: the others are still listed, the broken one named on stderr
    with its error, exit 2."""
    import shutil

    from launcher_core.paths import profile_dir

    for name in ("cpu-demo", "rtx6000-x8"):
        shutil.copy(profile_dir() / f"{name}.toml", tmp_path)
    (tmp_path / "broken.toml").write_text("[train\nlr = 1\n")
    env = {**os.environ, "DFLASH_PROFILES_DIR": str(tmp_path)}
    result = run_cli("profiles", env=env)
    assert result.returncode == 2, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["cpu-demo", "rtx6000-x8"]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: profile broken does not load: {tmp_path / 'broken.toml'}: not valid TOML")
    listed = json.loads(run_cli("profiles", "--json", env=env).stdout)
    assert [row["name"] for row in listed if "error" not in row] == ["cpu-demo", "rtx6000-x8"]
    (tmp_path / "broken.toml").unlink()                       # the control: all good, exit 0, nothing on stderr
    assert run_cli("profiles", env=env).returncode == 0
