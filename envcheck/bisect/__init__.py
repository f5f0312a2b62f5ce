"""Dependency bisect: which change between a GOOD and a BAD requirement set causes a memory
regression. `reqsets` reads the sets, `changes` groups their differences, `search` is the binary
search, `venvs` builds candidates with uv, `log` makes the search resumable, `runner` drives it
and `bisect_report` tells what it found."""
