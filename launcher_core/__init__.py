"""The shared core every floor builds on: errors and exit codes, atomic file I/O, the profile
schema and loader (with its JSON round trip), redaction of secrets, paths and the run manifest.

It imports nothing of `envcheck/` (machine) or `dflash/` (workload); both import it. The name is
specific on purpose: `launcher.py probe --import NAME` runs from the repository root, where a
package called plain `core` would shadow a user's own `core`.
"""
