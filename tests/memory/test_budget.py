"""Per-rank budgets: GPU mapping, overhead sources, margin, agreement on the minimum, exact global batch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash.memory import budget
from dflash.memory import peak_estimate as memory
from dflash.memory.calibration_record import fit_calibration
from envcheck.snapshot import GpuFacts, Snapshot
from launcher_core.errors import ConfigError, InputError
from launcher_core.profile import load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"
UUIDS = ["GPU-aaaa0000-1111", "GPU-bbbb0000-2222", "GPU-cccc0000-3333", "GPU-aaaa9999-4444"]


def snapshot(free: list[int], context: list[int | None] | None = None) -> Snapshot:
    context = context or [None] * len(free)
    return Snapshot(gpus=[GpuFacts(index=i, uuid=UUIDS[i], name="NVIDIA RTX PRO 6000", compute_capability="12.0",
                                   memory_total_mib=97_887, memory_free_mib=f, memory_used_mib=97_887 - f, context_mib=c)
                          for i, (f, c) in enumerate(zip(free, context))])


def write_profile(tmp_path, body: str):
    path = tmp_path / "node.toml"
    path.write_text('[machine]\ndevice = "cuda"\nnproc_per_node = 2\nbackend = "gloo"\n'
                    '[model]\ntarget = "no-such-dir"\n' + body)
    return load_profile(str(path))


def test_cuda_visible_devices_maps_ordinals_to_nvml_indices_and_uuid_prefixes():
    gpus = budget.gpus_from_snapshot(snapshot([1, 2, 3, 4]))
    assert [g.index for g in budget.visible_gpus(gpus, None)] == [0, 1, 2, 3]
    assert [g.index for g in budget.visible_gpus(gpus, "2,0")] == [2, 0]
    assert [g.index for g in budget.visible_gpus(gpus, "GPU-bbbb,GPU-aaaa9")] == [1, 3]
    with pytest.raises(ConfigError, match="'GPU-aaaa' is ambiguous"):
        budget.visible_gpus(gpus, "GPU-aaaa")
    with pytest.raises(ConfigError, match="'7' matches no GPU"):
        budget.visible_gpus(gpus, "0,7")


def test_a_bad_snapshot_file_is_an_input_error_naming_the_file_and_the_key(tmp_path):
    """The plan reads a snapshot file as `Snapshot` (envcheck.snapshot): a missing, unknown or mistyped
    key stops it with the file and the key's path named, before any budget is computed."""
    from dflash.memory.launch_plan import read_inputs
    from envcheck.snapshot import save_snapshot

    profile = write_profile(tmp_path, "")
    good = save_snapshot(snapshot([10_000, 6_500]), tmp_path / "good.json").read_text()
    cases = {"missing": good.replace('"memory_free_mib": 6500,', ""),
             "mistyped": good.replace('"memory_free_mib": 6500', '"memory_free_mib": "6500 MiB"'),
             "unknown": good.replace('"memory_free_mib": 6500', '"memory_free": 6500')}
    expected = {"missing": r"snapshot\.gpus\[1\]: missing key\(s\) memory_free_mib",
                "mistyped": r"snapshot\.gpus\[1\]\.memory_free_mib: expected int, got '6500 MiB'",
                "unknown": r"snapshot\.gpus\[1\]: unknown key\(s\) memory_free;"}
    for case, text in cases.items():
        path = tmp_path / f"{case}.json"
        path.write_text(text)
        with pytest.raises(InputError, match=rf"^{re.escape(str(path))}: not a valid snapshot: {expected[case]}"):
            read_inputs(profile, path)


def test_a_live_snapshot_and_its_file_give_the_same_plan(tmp_path, monkeypatch):
    """`plan` on the node (this machine's GPUs through NVML) and `plan --snapshot FILE` with that
    snapshot saved read the same `Snapshot` and give the same plan, the host's saved baseline
    supplying the overheads NVML does not measure. NVML cannot run without a GPU: its facts here are
    the recorded node's, without the CUDA probe's figures (a stand-in for `nvml_facts.collect`)."""
    import dataclasses
    import socket

    from dflash.memory import launch_plan
    from envcheck import nvml_facts
    from envcheck.baseline import baseline_path
    from envcheck.snapshot import load_snapshot, save_snapshot

    monkeypatch.setenv("DFLASH_BASELINE_DIR", str(tmp_path / "baselines"))
    recorded = load_snapshot(FIXTURES / "rtx6000-x8-baseline.json")          # probed: 598 MiB of context per GPU
    save_snapshot(recorded, baseline_path("rtx6000-x8", socket.gethostname()))
    unprobed = [dataclasses.replace(gpu, context_mib=None, kernel_ok=None) for gpu in recorded.gpus]
    monkeypatch.setattr(nvml_facts, "collect", lambda: (recorded.nvml, unprobed))
    profile = load_profile("rtx6000-x8")
    live = launch_plan.read_inputs(profile)
    assert live.snapshot_source == "NVML" and isinstance(live.snapshot, Snapshot) and live.baseline == recorded
    from_file = launch_plan.read_inputs(profile, save_snapshot(live.snapshot, tmp_path / "node.json"))
    assert from_file.snapshot == live.snapshot and from_file.baseline == recorded
    plans = [launch_plan.plan_for_launch(profile, inputs, cuda_visible_devices=None) for inputs in (live, from_file)]
    assert plans[0] == plans[1]
    assert {(r.budget.overhead_source, r.budget.overhead_mib) for r in plans[0].ranks} == {("baseline", 598)}


def test_overhead_prefers_probe_then_baseline_then_profile_then_default(tmp_path):
    profile = write_profile(tmp_path, "[memory]\noverhead_mib = 700\n")
    probed, unprobed = budget.gpus_from_snapshot(snapshot([50_000, 50_000], [610, None]))
    known = budget.baseline_index(snapshot([60_000, 60_000], [None, 555]))
    assert budget.overhead_for(probed, profile, known) == (610, "probe")
    assert budget.overhead_for(unprobed, profile, known) == (555, "baseline")
    assert budget.overhead_for(unprobed, profile, {}) == (700, "profile")
    default_profile = write_profile(tmp_path, "")
    assert budget.overhead_for(unprobed, default_profile, {}) == (budget.DEFAULT_OVERHEAD_MIB, "default")


def test_budget_is_free_minus_overhead_minus_margin_of_free(tmp_path):
    profile = write_profile(tmp_path, "[memory]\nmargin = 0.2\n")
    gpu = budget.gpus_from_snapshot(snapshot([10_000], [500]))[0]
    result = budget.rank_budget(3, gpu, profile, {})
    assert (result.free_mib, result.overhead_mib, result.margin_mib, result.budget_mib) == (10_000, 500, 2_000, 7_500)


def test_batch_plan_keeps_the_global_batch_exact():
    for world, micro in [(8, 4), (8, 3), (2, 1), (4, 5)]:
        plan = budget.batch_plan(64, world, micro)
        assert sum(plan.micro_batch_sizes) * world == 64
        assert len(plan.micro_batch_sizes) == plan.accum_steps
        assert max(plan.micro_batch_sizes) == plan.micro_batch
    assert budget.batch_plan(64, 8, 3).micro_batch_sizes == (3, 3, 2)
    with pytest.raises(ConfigError, match="train.global_batch: 10 is not a positive multiple of the 4 ranks"):
        budget.batch_plan(10, 4, 1)


def calibration_giving(workload: memory.Workload, intercept: float = 2000.0, slope: float = 1500.0,
                       reserve_ratio: float | None = None):
    """A calibration (2 measuring ranks, steps of 2 micro-batches) whose corrected plan is exactly
    peak = intercept + slope x m for `workload` while its micro-batches accumulate; with `reserve_ratio`,
    reserved peaks that ratio over the allocated ones, measured under expandable segments."""
    import dataclasses

    measured = memory.estimated_peak_model(dataclasses.replace(workload, world_size=2, rank_share=3))
    estimated = memory.estimated_peak_model(workload)
    peaks = {m: measured.step_mib(m) + intercept + slope * m - estimated.step_mib(m) for m in (1, 2)}
    reserved = None if reserve_ratio is None else {m: peak * reserve_ratio for m, peak in peaks.items()}
    return fit_calibration(peaks, workload, reserved, world_size=2, micro_batches_per_step=2,
                           expandable_segments=True)


def calibrated_plan(profile, free: list[float], **kwargs) -> budget.Plan:
    calibration = calibration_giving(memory.workload_from_profile(profile))
    return budget.make_plan(profile, snapshot(free, [500] * len(free)), calibration=calibration, **kwargs)


def test_the_rank_with_least_headroom_sets_everyones_micro_batch(tmp_path):
    profile = write_profile(tmp_path, "[train]\nglobal_batch = 16\nmax_micro_batch = 4\n")
    plan = calibrated_plan(profile, [10_000, 6_500])        # budgets 8500 and 5350
    assert [r.feasible_micro_batch for r in plan.ranks] == [4, 2]
    assert plan.bottleneck_ranks == (1,)
    assert (plan.batch.micro_batch, plan.batch.accum_steps) == (2, 4)
    assert all(r.peak_at_agreed_mib == pytest.approx(5_000.0) for r in plan.ranks)
    assert plan.peak_model.source == "calibration"


def test_ranks_follow_cuda_visible_devices(tmp_path):
    profile = write_profile(tmp_path, "[train]\nglobal_batch = 16\n")
    plan = calibrated_plan(profile, [10_000, 6_500, 10_000], cuda_visible_devices="2,0")
    assert [r.budget.gpu.index for r in plan.ranks] == [2, 0]
    assert plan.bottleneck_ranks == () and plan.batch.micro_batch == 4
    with pytest.raises(ConfigError, match="only 1 GPUs are visible"):
        calibrated_plan(profile, [10_000, 6_500], cuda_visible_devices="1")


def test_launch_plan_gives_each_rank_its_start_and_refuses_when_one_sequence_cannot_fit(tmp_path, monkeypatch):
    from dflash.memory.launch_plan import PlanInputs, allocator_fraction, plan_for_launch, rank_starts
    from launcher_core.errors import PreflightFailed

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    profile = write_profile(tmp_path, "[train]\nglobal_batch = 16\n")
    calibration = calibration_giving(memory.workload_from_profile(profile))
    inputs = PlanInputs(snapshot([10_000, 6_500], [500, 500]), None, calibration, "test", "calibration")
    starts = rank_starts(plan_for_launch(profile, inputs))
    assert [start.micro_batch for start in starts] == [4, 2]
    assert allocator_fraction(starts[1]) == pytest.approx(starts[1].budget_mib / 97_887)
    short = PlanInputs(snapshot([10_000, 3_500], [500, 500]), None, calibration, "test", "calibration")
    with pytest.raises(PreflightFailed, match=r"rank 1: one sequence needs 3675 MiB \(3500 allocated x reserve ratio "
                                              r"1\.050\) but GPU 1's budget is 2650 MiB"):
        plan_for_launch(profile, short)


def test_cuda_profile_without_snapshot_asks_for_one(tmp_path):
    with pytest.raises(ConfigError, match="--snapshot"):
        budget.make_plan(write_profile(tmp_path, ""), None)
    recorded = snapshot([10_000, 10_000])
    with pytest.raises(ConfigError, match="only 0 GPUs are visible"):     # CUDA's meaning of ""
        budget.make_plan(write_profile(tmp_path, ""), recorded, cuda_visible_devices="")


def test_cpu_profile_plans_without_gpu_budgets():
    plan = budget.make_plan(load_profile("cpu-demo"))
    assert [r.budget.gpu for r in plan.ranks] == [None, None]
    assert plan.batch.micro_batch == 4 and plan.batch.accum_steps == 1
