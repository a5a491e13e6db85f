"""Test fixtures' building blocks: a private redis-server, a scripted OpenAI-compatible model
server, and real worker processes."""
