"""Data-node internals: a backend's regions served by transports; the registering agent."""
