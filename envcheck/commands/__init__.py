"""Machine subcommands (audit, snapshot, baseline, probe, bisect). Each defines
`add_arguments(parser)` and `run(args) -> int` and keeps heavy imports inside `run`."""
