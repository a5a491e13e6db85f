"""Tools from MCP servers: listed when an agent is resolved (`listing.py`), called from the
worker through connections kept per process (`pool.py`) or, for runIsolated, by a one-shot client
started inside the sandbox with the server (`oneshot.py`); results mapped onto tool results
(`results.py`). `agents mcp-server` (`server.py`) is celery-agents itself as an MCP server."""
