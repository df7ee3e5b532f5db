"""Command line and tooling: the CLI, server commands, demo, bench, stats output, test cluster."""
