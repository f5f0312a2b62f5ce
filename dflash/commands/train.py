"""`launcher.py train --profile P`: preflight audit, then torchrun training of the DFlash drafter."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from launcher_core.cli import add_profile_option, load_profile_arg

if TYPE_CHECKING:
    from dflash.memory.budget import Plan
    from launcher_core.schema import Profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: the profile's paths.run_dir)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("--start-over", action="store_true",
                        help="start over where the run directory holds checkpoints (the old train/ is kept as "
                             "train.prev-<time>, on the same disk)")
    parser.add_argument("--force", action="store_true",
                        help="train even if the preflight audit FAILs, and --start-over; the disk and RAM checks "
                             "still run")
    parser.add_argument("--skip-resource-checks", action="store_true",
                        help="train even where the run's checkpoints do not fit the free disk or its ranks' start "
                             "does not fit the node's RAM")
    parser.add_argument("--skip-preflight", action="store_true", help="do not run the preflight audit at all")
    parser.add_argument("--print-command", action="store_true",
                        help="print the memory plan and the torchrun command (per node) and exit; starts nothing")
    parser.add_argument("--snapshot", metavar="FILE", type=Path,
                        help="plan for the node this snapshot recorded (dry runs, tests; default: this machine's GPUs)")
    parser.add_argument("--baseline", metavar="FILE", type=Path,
                        help="baseline with overheads and the memory calibration (default: the profile's saved baseline)")


def run(args: argparse.Namespace) -> int:
    from dflash.memory.launch_plan import describe, plan_for_launch, read_inputs
    from dflash.train.supervisor.launch import build_torchrun_command, describe_command, run_training
    from dflash.train.supervisor.launch_checks import require_dataset, validate_profile_for_launch
    from dflash.train.supervisor.resume import finished_run
    from launcher_core.profile import expand_path
    from launcher_core.runlock import run_lock

    profile = load_profile_arg(args)
    run_dir = Path(args.run_dir).resolve() if args.run_dir else expand_path(profile, profile.paths.run_dir)
    validate_profile_for_launch(profile, source=args.profile)
    if not args.print_command:
        require_dataset(profile, source=args.profile)   # train before tokenize: said here, not by a rank after launch
    inputs = read_inputs(profile, args.snapshot, args.baseline)
    plan = plan_for_launch(profile, inputs)
    print(describe(plan, inputs), flush=True)
    if args.print_command:
        print(describe_command(*build_torchrun_command(profile, run_dir, resume=args.resume)))
        return 0
    with run_lock(run_dir, "train"):              # one run per directory, from the preflight on
        if args.resume and (finished := finished_run(profile, run_dir)):
            print(finished, flush=True)
            return 0
        if not args.skip_preflight:
            _preflight(profile, run_dir, force=args.force, plan=plan, ram=not args.skip_resource_checks)
        return run_training(profile, run_dir=run_dir, start_over=args.start_over or args.force, resume=args.resume,
                            skip_resource_checks=args.skip_resource_checks, plan=(plan, inputs))


def _preflight(profile: Profile, run_dir: Path, *, force: bool, plan: Plan, ram: bool) -> None:
    """The audit stops the run on any FAIL (its findings printed), unless --force; with `ram` (no
    --skip-resource-checks) it holds the node's RAM against the host RAM the plan's ranks need at start
    (dflash.memory.host_ram)."""
    from dflash.memory.host_ram import host_ram_at_start
    from envcheck.checks import RamNeed
    from envcheck.preflight import run_preflight

    need = host_ram_at_start(profile, plan)
    run_preflight(profile, force=force, run_dir=run_dir,
                  ram_at_start=RamNeed(need.node_mib, f"{need.ranks} x ({need.terms()})") if ram else None)
