"""``python -m kvfabric``: the command line."""

from kvfabric._tools.cli import main

raise SystemExit(main())
