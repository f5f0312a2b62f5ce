"""`export --force` replaces only a folder export wrote (issue row "export --force -o DIR where DIR is
a downloaded drafter"): the marker file export writes is what makes a folder its own, not the
absence of training_state.pt."""
from __future__ import annotations

import json
import shutil

from launcher_core.outputs import EXPORT_MARKER
from tests.safety.conftest import save_real_checkpoint, tree_digest
from tests.train.conftest import write_dataset, write_profile


def test_force_replaces_an_export_of_ours_but_never_a_downloaded_drafter(cli, tmp_path, tiny_qwen3_target):
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=8), tmp_path / "run")
    checkpoint = save_real_checkpoint(profile, tmp_path / "run", 1)
    ours = tmp_path / "exported"
    first = cli("export", checkpoint, "--for", "sglang", "-o", ours)
    assert first.code == 0, first.err
    marker = json.loads((ours / EXPORT_MARKER).read_text())
    assert marker["written_by"] == "launcher.py export" and marker["engine"] == "sglang"
    downloaded = tmp_path / "z-lab-drafter"            # what a hub download looks like: no marker of ours
    shutil.copytree(ours, downloaded)
    (downloaded / EXPORT_MARKER).unlink()
    (downloaded / "README.md").write_text("# a published DFlash drafter\n")
    before = tree_digest(downloaded)
    refused = cli("export", checkpoint, "--for", "vllm", "-o", downloaded, "--force")
    assert refused.code == 2, refused.err
    assert f"-o {downloaded} is an existing folder that is not a drafter export; nothing was touched" in refused.err
    assert tree_digest(downloaded) == before                     # README.md and the weights as they were
    again = cli("export", checkpoint, "--for", "vllm", "-o", ours, "--force")     # the control: ours is replaced
    assert again.code == 0, again.err
    assert json.loads((ours / EXPORT_MARKER).read_text())["engine"] == "vllm"
    without = cli("export", checkpoint, "--for", "vllm", "-o", ours)
    assert without.code == 2 and "is an existing drafter export; pass --force" in without.err
