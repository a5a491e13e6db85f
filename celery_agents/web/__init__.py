"""`agents serve`: the HTTP API (`/v1`), the approvals page (`/`), `/metrics` and `/docs`.

FastAPI on uvicorn, over `celery_agents.Client`: every route is an operation the CLI has, with the
CLI's JSON documents. Imported only by `agents serve`, so other commands never pay for FastAPI.
"""
