"""Persisted schemas: the lock file and its check, and the AsyncAPI contract of the event topics."""
