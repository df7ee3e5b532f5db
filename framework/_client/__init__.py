"""Client internals: Store, AsyncStore, record I/O, prefetch cache, embedded and remote wiring."""
