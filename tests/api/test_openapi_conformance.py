"""/openapi.json is what the server does: schemathesis, every check, against a live esk.

Clients in other languages are generated from the document, so each answer the server
gives must be declared (status, media type, headers, body schema), and each request the
document calls valid must be taken. schemathesis runs its CLI as a user would, with the
settings in tests/api/schemathesis.toml (what they allow, and why, is said there), over every
operation: examples, coverage (boundaries and every parameter's invalid forms), fuzzing and
stateful sequences.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from esk.settings import Settings
from tests.system import system

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("schemathesis.toml")
# Cases per operation in the fuzzing and stateful phases (the coverage phase derives its own
# from the document): what bounds the run's time.
MAX_EXAMPLES = 10
BUDGET_S = 240.0
TOKEN = "conformance-token"


def conformance_settings(settings: Settings, auth: bool) -> Settings:
    # A min_version that is not reached waits this long before its 503: the run asks for many.
    # short waits: a generated read may ask for positions no read model reaches
    api = settings.api.model_copy(
        update={"min_version_timeout_s": 0.2, "read_wait_max_s": 0.2, "auth_tokens": [TOKEN] if auth else []}
    )
    return settings.model_copy(update={"api": api})


async def schemathesis(base_url: str, *options: str) -> tuple[int, str]:
    """Run the schemathesis CLI against a server in this process's event loop, which goes on
    serving while it runs."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "--no-color",
        "run", f"{base_url}/openapi.json", "--checks", "all", "--max-examples", str(MAX_EXAMPLES), *options,
        cwd=ROOT,  # where the configuration's hooks module is imported from
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), BUDGET_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


@pytest.mark.timeout(BUDGET_S + 120)
@pytest.mark.parametrize("auth", [False, True], ids=["open", "bearer-auth"])
async def test_every_operation_conforms_to_the_document(settings: Settings, auth: bool) -> None:
    async with system(conformance_settings(settings, auth)) as s:
        spec = (await s.client.get("/openapi.json")).json()
        assert ("bearerAuth" in spec["components"].get("securitySchemes", {})) is auth
        # With auth the document differs in its security scheme and every operation's 401,
        # which the examples and the coverage phase reach on every operation; the fuzzing and
        # stateful phases exercise the same handlers as without, and are the open run's.
        options = ["--header", f"Authorization: Bearer {TOKEN}", "--phases", "examples,coverage"] if auth else []
        code, output = await schemathesis(str(s.client.base_url), *options)
    assert code == 0, output
    operations = sum(len(item) for item in spec["paths"].values())
    assert f"Tested: {operations}\n" in output, output
