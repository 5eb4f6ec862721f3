"""realtime.engines."""
