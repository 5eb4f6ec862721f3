"""Sans-I/O wire protocol: no asyncio, starlette or torch here."""
