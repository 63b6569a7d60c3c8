"""A read models module with a bug at its import, as ESK_READ_MODELS may name one: the
API answers reads of read models with the reason (tests/api/test_http_contract.py)."""

raise RuntimeError("a bug in the user's read models module")
