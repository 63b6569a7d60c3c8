"""The example's read models (PySpark into Delta Lake), written as any user's are: against
esk's projection API, registered by the default `ESK_READ_MODELS` (`projections:READ_MODELS`).
Importing this needs the spark extra."""

from .read_models import READ_MODELS

__all__ = ["READ_MODELS"]
