"""Index plugins (entry-point group ``kvfabric.indexes``): the built-in ``memory`` (in the
controller's process) and ``redis`` (Redis, Redis Cluster or Valkey; no controller)."""
