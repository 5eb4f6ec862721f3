"""realtime.codecs."""
