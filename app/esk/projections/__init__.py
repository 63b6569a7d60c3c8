"""Category read models built by PySpark Structured Streaming into Delta Lake tables.

- `catalog.py`: which read models exist and where their tables are (no Spark needed, so
  the HTTP API can read them with delta-rs).
- `events.py`: the event stream as a DataFrame, decoded with schemas derived from the
  domain's event models and upcast by the domain's own upcasters.
- `runner.py`: runs a projection exactly once into Delta (idempotent MERGE per batch).
- `read_models.py`: the shipped projections.
"""
