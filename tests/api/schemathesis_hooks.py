"""schemathesis hooks for tests/api/schemathesis.toml: esk's own check, and values for the
`entity-tag` format of If-Match."""

from __future__ import annotations

import schemathesis
from hypothesis import strategies as st
from schemathesis import CheckContext, Response
from schemathesis.generation.case import Case

from esk.api.commands import VERSION_TAG_PATTERN

# The coverage phase builds header values from letters and digits only, so it has no valid
# If-Match (a quoted version) of its own; without one it sends an invalid value in cases it
# counts as valid.
schemathesis.openapi.format("entity-tag", st.from_regex(VERSION_TAG_PATTERN, fullmatch=True))

# The problem codes of a 422 that refuses the request's form, not the state it met.
FORM_REFUSALS = frozenset({"invalid_payload", "invalid_request"})


@schemathesis.check
def schema_valid_form_accepted(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """positive_data_acceptance lets a 422 through for a schema-valid request, since a
    domain's rejections are 422s; a 422 that says the payload or a parameter is invalid
    means the document and the server disagree on what is valid."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 422:
        return None
    code = response.json().get("code")
    if code in FORM_REFUSALS:
        raise AssertionError(f"a request valid by the document was refused as {code}: {response.text}")
    return None
