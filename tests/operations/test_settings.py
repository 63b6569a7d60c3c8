"""A setting esk cannot take is named as the user set it, in a line (pydantic's error names
fields by their dotted path, over many lines, under a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from esk.settings import SettingsInvalid, read_settings, unknown_variables


@pytest.mark.parametrize(
    ("variables", "told"),
    [
        ({"ESK_API__PORT": "abc"}, "ESK_API__PORT: Input should be a valid integer, unable to parse string as an integer"),
        ({"ESK_LOG_FORMAT": "xml"}, "ESK_LOG_FORMAT: Input should be 'text' or 'json'"),
        (
            {"ESK_API__PORT": "abc", "ESK_TOPICS__PARTITIONS": "many"},
            "ESK_TOPICS__PARTITIONS: Input should be a valid integer, unable to parse string as an integer; "
            "ESK_API__PORT: Input should be a valid integer, unable to parse string as an integer",
        ),
        # a misspelt name sets a section that wants more: what it set is told beside
        (
            {"ESK_BROKER__SASL_SSL__INTERNAL_PORT": "19202"},
            "ESK_BROKER__SASL_SSL__KEYSTORE: Field required (ESK_BROKER__SASL_SSL__* sets only INTERNAL_PORT)",
        ),
        ({"ESK_API__AUTH_TOKENS": "t1,t2"}, "ESK_API__AUTH_TOKENS: not JSON"),
        ({"esk_api__auth_tokens": "t1,t2"}, "ESK_API__AUTH_TOKENS: not JSON"),  # pydantic reads any case
        ({"ESK_BROKER__SASL_SSL__USERS": "esk=secret"}, "ESK_BROKER__SASL_SSL__USERS: not JSON"),
        ({"ESK_BROKER": "localhost"}, "ESK_BROKER: not JSON"),
        # a section given whole, as JSON: told by the variable set, the field beside it
        ({"ESK_API": '{"port": "abc"}'}, "ESK_API (port): Input should be a valid integer"),
        ({"ESK_BROKER": '{"sasl_ssl": {"internal_port": 1}}'}, "ESK_BROKER (sasl_ssl.keystore): Field required"),
    ],
    ids=[
        "integer", "choice", "two at once", "missing beside a misspelt one", "list", "list, lower case", "nested mapping", "section",
        "a section's field", "a nested section's field",
    ],
)
def test_a_setting_esk_cannot_take_is_named_as_it_was_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variables: dict[str, str], told: str
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env of the checkout's
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsInvalid) as error:
        read_settings()
    assert str(error.value).startswith(told), str(error.value)
    assert "secret" not in str(error.value)


def test_every_command_tells_a_wrong_setting_in_a_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "esk", "project", "list"],
        cwd=tmp_path, env={"ESK_API__PORT": "abc", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: ESK_API__PORT: Input should be a valid integer, unable to parse string as an integer"
    ]


@pytest.mark.parametrize("where", ["environment", ".env"])
def test_with_json_logs_a_wrong_setting_is_told_in_json(tmp_path: Path, where: str) -> None:
    """A log pipeline that reads the process's JSON lines reads this one too."""
    env = {"ESK_API__PORT": "abc", "PATH": "/usr/bin:/bin"}
    if where == ".env":
        (tmp_path / ".env").write_text("ESK_LOG_FORMAT=json\n")
    else:
        env["ESK_LOG_FORMAT"] = "json"
    result = subprocess.run([sys.executable, "-m", "esk", "project", "list"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    told = json.loads(line)
    assert told["level"] == "ERROR" and told["message"] == "ESK_API__PORT: Input should be a valid integer, unable to parse string as an integer"


def test_a_variable_that_names_no_setting_is_told_with_the_one_it_may_mean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic passes over it: the setting meant keeps its default (a port on a shared machine)."""
    for name in [n for n in os.environ if n.upper().startswith("ESK_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ESK_API__PROT", "19111")
    monkeypatch.setenv("esk_brokr__port", "19100")  # any case, as pydantic reads them
    monkeypatch.setenv("ESK_API__PORT", "19110")
    monkeypatch.setenv("ESK_CACHE_DIR", "/tmp")  # read by esk, no field of Settings
    monkeypatch.setenv("ESK_API", "{}")  # a section given whole
    monkeypatch.setenv("ESK_KAFKA__EXTRA__CONNECTIONS_MAX_IDLE_MS", "1000")  # a mapping's entry, set alone
    (tmp_path / ".env").write_text("ESK_KAFKA__BOOTSTRAP_SERVRS=localhost:9092\nESK_APP=shop\nOTHER=1\n")
    assert unknown_variables() == [
        "ESK_API__PROT is no setting of esk: ESK_API__PORT, perhaps",
        "ESK_BROKR__PORT is no setting of esk: ESK_BROKER__PORT, perhaps",
        "ESK_KAFKA__BOOTSTRAP_SERVRS (in .env) is no setting of esk: ESK_KAFKA__BOOTSTRAP_SERVERS, perhaps",
    ]
    monkeypatch.setenv("ESK_ZZZZZZZZ", "1")
    assert "ESK_ZZZZZZZZ is no setting of esk" in unknown_variables()
    # every command says so as it starts
    result = subprocess.run(
        [sys.executable, "-m", "esk", "project", "list"],
        cwd=tmp_path, env={"ESK_API__PROT": "19111", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    )
    assert "WARNING" in result.stderr and "ESK_API__PROT is no setting of esk: ESK_API__PORT, perhaps: it is passed over" in result.stderr
