"""Settings of the read-model tests that run over the counters (tests/counters.py)."""

from __future__ import annotations

from pathlib import Path

from esk.settings import Settings


def counters_settings(settings: Settings, tmp_path: Path, read_models: str, **projections: object) -> Settings:
    """`settings` for the counters and `read_models` ("module:attribute"), their warehouse
    in `tmp_path`, and `projections`' settings besides."""
    return settings.model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "read_models": read_models,
            "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse", **projections}),
        }
    )
