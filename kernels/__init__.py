"""realtime.kernels."""
