"""Engine adapters (LMCache, vLLM); each is imported by its engine, never by kvfabric itself."""

__all__: list[str] = []
