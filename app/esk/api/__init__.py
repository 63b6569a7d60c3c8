"""The HTTP API: commands in, outcomes and state out (FastAPI on uvicorn)."""
