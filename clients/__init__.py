"""realtime.clients."""
