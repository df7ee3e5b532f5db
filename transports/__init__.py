"""Built-in transports; each module is a plugin selected by entry-point name."""

__all__: list[str] = []
