"""Command line and tooling: the CLI, server commands, demo, bench, stats output, and the
local cluster of real processes the bench measures against."""
