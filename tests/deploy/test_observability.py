"""deploy/prometheus/ and deploy/grafana/: the alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`, which fail when an alert stops firing), and every
metric the rules and the dashboard query is one esk exports: a renamed metric would leave
a panel empty and an alert silent, and nothing else would say so."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = ROOT / ".tools/bin/promtool"
RULES = ROOT / "deploy/prometheus/esk-alerts.yml"
RULE_TESTS = ROOT / "deploy/prometheus/esk-alerts.test.yml"
DASHBOARD = ROOT / "deploy/grafana/esk-dashboard.json"
PACKAGE = ROOT / "app/esk"
# Series Prometheus makes itself for each target it scrapes, not esk.
PROMETHEUS_MADE = {"up"}
# The suffixes of the series a metric family of each type is exposed as.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}
# Grafana's own variables, replaced by what Grafana would put there before parsing.
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")


@pytest.fixture(scope="module", autouse=True)
def promtool() -> None:
    if shutil.which("go") is None and not PROMTOOL.exists():
        pytest.skip("go is missing: promtool is built with it (make tools-promtool)")
    if not PROMTOOL.exists():
        subprocess.run(["make", "--no-print-directory", "tools-promtool"], cwd=ROOT, check=True)


def run_promtool(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


# -- the rules, through promtool ---------------------------------------------------------


def test_the_rules_pass_promtool_check() -> None:
    done = run_promtool("check", "rules", RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"SUCCESS: (\d+) rules found", done.stdout)


def test_the_alerts_fire_when_they_should_and_not_otherwise() -> None:
    done = run_promtool("test", "rules", RULE_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rule_tests_fail_when_an_alert_no_longer_fires(tmp_path: Path) -> None:
    """The control for the test above: the same tests against rules whose lag threshold
    is too high for the lag series."""
    changed = RULES.read_text().replace("max by (namespace, partition) (esk_commands_lag) > 1000", "max by (namespace, partition) (esk_commands_lag) > 10000")
    assert changed != RULES.read_text()
    (tmp_path / RULES.name).write_text(changed)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    done = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
    assert "EskCommandsLagHigh" in done.stdout + done.stderr


# -- every queried metric is exported ------------------------------------------------------


def metric_modules() -> list[str]:
    """The modules of esk that define Prometheus metrics."""
    defines = re.compile(r"^from prometheus_client import .*\b(Counter|Gauge|Histogram|Summary|Info)\b", re.MULTILINE)
    return sorted(
        ".".join(("esk", *path.relative_to(PACKAGE).with_suffix("").parts))
        for path in PACKAGE.rglob("*.py")
        if defines.search(path.read_text())
    )


@cache
def exported() -> frozenset[str]:
    """The names of the series esk's processes expose: those of the metrics its modules
    define (labelled ones have no sample before their first use) and those of the
    collectors prometheus_client registers by itself (process_*, python_*)."""
    for module in metric_modules():
        importlib.import_module(module)
    names: set[str] = set()
    for family in REGISTRY.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return frozenset(names)


def queried(expression: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    found: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            found.add(node.name)

    promql_parser.walk(promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expression)), visit)
    return found


def rule_expressions() -> dict[str, str]:
    rules = yaml.safe_load(RULES.read_text())
    return {rule.get("alert") or rule["record"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_expressions() -> dict[str, str]:
    expressions = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expressions[f"{panel['title']} {target['refId']}"] = target["expr"]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(METRIC, LABEL) is Grafana's, not PromQL: its selector is.
            [selector] = re.findall(r"^label_values\((.+),\s*\w+\)$", variable["query"]["query"])
            expressions[f"${variable['name']}"] = selector
    return expressions


def test_esk_exports_what_the_rules_and_the_dashboard_query() -> None:
    assert metric_modules() == ["esk.metrics"], "a module of its own would have to be scraped too"
    expressions = {**{f"rule {k}": v for k, v in rule_expressions().items()}, **{f"panel {k}": v for k, v in dashboard_expressions().items()}}
    assert len(expressions) > 25
    unknown = {where: sorted(queried(expr) - exported() - PROMETHEUS_MADE) for where, expr in expressions.items()}
    assert {where: names for where, names in unknown.items() if names} == {}
    used = set().union(*(queried(expr) for expr in expressions.values()))
    # What the issue asked to watch, each in a rule or on the dashboard.
    assert {
        "esk_commands_lag", "esk_subscription_lag", "esk_active_tasks", "esk_subscription_partitions", "esk_restore_remaining_records",
        "esk_subscription_events_total", "esk_commit_seconds_bucket", "esk_commands_total", "up",
    } <= used


def test_a_misspelt_metric_would_be_caught() -> None:
    """The control for the test above."""
    assert queried('sum by (le) (rate(esk_comit_seconds_bucket{namespace=~"$namespace"}[$__rate_interval]))') - exported() == {"esk_comit_seconds_bucket"}
    assert {"esk_commit_seconds_bucket", "esk_commands_total", "esk_commands_lag", "process_resident_memory_bytes"} <= exported()
    with pytest.raises(ValueError, match="unclosed left parenthesis"):  # a typo is not silently no name
        queried("sum by (le) (rate(esk_commit_seconds_bucket[5m])")


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "subscription"}
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            for target in panel["targets"]:
                assert 'namespace=~"$namespace"' in target["expr"], f"{panel['title']}: follows the namespace chosen"
