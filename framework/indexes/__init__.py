"""Index plugins (entry-point group ``kvfabric.indexes``); ``memory`` is the built-in."""
