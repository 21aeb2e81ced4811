"""API stage: the runtime behind every generated package's `attention()` (fa4gen.api.runtime)."""
