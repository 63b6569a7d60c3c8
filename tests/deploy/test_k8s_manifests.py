"""deploy/k8s/: rendered by kustomize (base and overlay), validated offline by kubeconform
-strict against the Kubernetes JSON schemas (make tools-kubeconform provides all three), and
held to the code and the Dockerfile: every container runs an `esk` command that exists, every
ESK_* variable is a setting (and the values parse), the pods run as the image's user, the
ports and state directories are where the settings and the image say."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from pydantic import BaseModel
from typer.core import TyperGroup

from esk.cli import cli
from esk.jars import CACHE_DIR_VARIABLE
from esk.projections.catalog import configured_read_models
from esk.settings import Settings
from esk.subscriptions.api import DatabaseHandler
from esk.subscriptions.catalog import configured_subscriptions
from esk.subscriptions.database import SQLite
from tests.deploy import k8s_schemas

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = {"base": ROOT / "deploy/k8s/base", "example": ROOT / "deploy/k8s/overlays/example"}
KUBECONFORM = ROOT / ".tools/bin/kubeconform"
KUSTOMIZE = ROOT / ".tools/bin/kustomize"
DOCKERFILE = ROOT / "Dockerfile"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
# Every workload each kustomization deploys, by its app.kubernetes.io/component label: the
# example overlay takes the read models' component (components/read-models).
BASE_COMPONENTS = {"processor": "StatefulSet", "api": "Deployment", "topics-init": "Job", "subscriber": "StatefulSet"}
COMPONENTS = {"base": BASE_COMPONENTS, "example": BASE_COMPONENTS | {"read-models": "StatefulSet"}}

Manifest = dict[str, Any]


@pytest.fixture(scope="module", autouse=True)
def tools() -> None:
    if shutil.which("go") is None:
        pytest.skip("go is missing: kubeconform and kustomize are built with it (make tools-kubeconform)")
    if not (KUBECONFORM.exists() and KUSTOMIZE.exists() and k8s_schemas.extracted()):
        subprocess.run(["make", "--no-print-directory", "tools-kubeconform"], cwd=ROOT, check=True)


@cache
def rendered(name: str) -> str:
    done = subprocess.run([KUSTOMIZE, "build", KUSTOMIZATIONS[name]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def manifests(name: str) -> list[Manifest]:
    return [m for m in yaml.safe_load_all(rendered(name)) if m]


def kubeconform(text: str, version: str) -> tuple[int, list[dict[str, str]], str]:
    """Validate `text` (-strict: unknown fields and duplicate keys are errors); the exit
    code and one result per resource. A proxy that refuses every connection: the schemas
    are read from local files, and any attempt to fetch one would fail the resource."""
    offline = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    done = subprocess.run(
        [KUBECONFORM, "-strict", "-summary", "-verbose", "-output", "json",
         "-kubernetes-version", version, "-schema-location", k8s_schemas.SCHEMA_LOCATION],
        input=text, capture_output=True, text=True, timeout=120, env=offline,
    )
    return done.returncode, json.loads(done.stdout)["resources"], done.stdout + done.stderr


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", k8s_schemas.KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_renders_and_validates(name: str, version: str) -> None:
    code, results, output = kubeconform(rendered(name), version)
    assert code == 0, output
    assert [r["status"] for r in results] == ["statusValid"] * len(manifests(name)), output  # none skipped
    kinds = {m["kind"] for m in manifests(name)}
    assert {"ConfigMap", "Secret", "Service", "StatefulSet", "Deployment", "Job", "PodDisruptionBudget"} <= kinds


def with_change(change: str) -> str:
    """The base, rendered, with one deliberate mistake in the processor's StatefulSet."""
    documents = manifests("base")
    processor = next(m for m in documents if m["kind"] == "StatefulSet" and m["metadata"]["name"] == "esk-processor")
    container = processor["spec"]["template"]["spec"]["containers"][0]
    if change == "replicas as a word":
        processor["spec"]["replicas"] = "three"
    elif change == "unknown field":
        container["livenessProbes"] = container["livenessProbe"]  # a typo
    elif change == "field in the wrong place":
        container["terminationGracePeriodSeconds"] = 120  # belongs to the pod, not the container
    elif change == "missing required field":
        del container["name"]
    return str(yaml.safe_dump_all(documents))


@pytest.mark.parametrize("change", ["replicas as a word", "unknown field", "field in the wrong place", "missing required field"])
def test_the_validator_rejects_a_schema_error(change: str) -> None:
    code, results, output = kubeconform(with_change(change), k8s_schemas.KUBERNETES_VERSIONS[-1])
    assert code != 0, output
    invalid = [r for r in results if r["status"] != "statusValid"]
    assert [(r["kind"], r["name"], r["status"]) for r in invalid] == [("StatefulSet", "esk-processor", "statusInvalid")], output


def test_an_unchanged_round_trip_still_validates() -> None:
    """The negative controls above differ from the valid base by their change alone."""
    code, _, output = kubeconform(str(yaml.safe_dump_all(manifests("base"))), k8s_schemas.KUBERNETES_VERSIONS[-1])
    assert code == 0, output


# -- the manifests against the code and the Dockerfile -------------------------------------


def workloads(documents: list[Manifest]) -> Iterator[Manifest]:
    return (m for m in documents if m["kind"] in WORKLOADS)


def pod_spec(workload: Manifest) -> Manifest:
    spec: Manifest = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Manifest) -> list[Manifest]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def component(documents: list[Manifest], name: str) -> Manifest:
    [found] = [w for w in workloads(documents) if w["metadata"]["labels"]["app.kubernetes.io/component"] == name]
    return found


def config_map(documents: list[Manifest]) -> dict[str, str]:
    [found] = [m for m in documents if m["kind"] == "ConfigMap" and m["metadata"]["name"].startswith("esk-settings")]
    data: dict[str, str] = found["data"]
    return data


def secret(documents: list[Manifest]) -> dict[str, str]:
    [found] = [m for m in documents if m["kind"] == "Secret" and m["metadata"]["name"] == "esk-secrets"]
    data: dict[str, str] = found.get("stringData", {})
    return data


@cache
def dockerfile() -> list[tuple[str, str]]:
    """The final stage's instructions, (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    instructions = [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def found(pattern: str, text: str) -> re.Match[str]:
    match = re.search(pattern, text)
    assert match, f"no {pattern!r} in {text!r}"
    return match


def dockerfile_args(instruction: str) -> list[str]:
    return [args for word, args in dockerfile() if word == instruction]


def dockerfile_env() -> dict[str, str]:
    return dict(item.split("=", 1) for args in dockerfile_args("ENV") for item in shlex.split(args))


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_container_runs_an_esk_command_that_exists(name: str) -> None:
    [entrypoint] = dockerfile_args("ENTRYPOINT")
    assert json.loads(entrypoint) == ["esk"]
    root = typer.main.get_command(cli)
    documents = manifests(name)
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"]: w["kind"] for w in workloads(documents)} == COMPONENTS[name]
    for workload in workloads(documents):
        for container in containers(workload):
            assert container.get("command", ["esk"]) == ["esk"], f"{workload['metadata']['name']}: the image's entrypoint runs esk"
            words = [str(word) for word in container["args"]]
            command, path = root, ["esk"]
            while isinstance(command, TyperGroup):
                assert words, f"{' '.join(path)} is a group of commands, not one"
                sub = command.get_command(command.make_context(" ".join(path), list(words)), words[0])
                assert sub is not None, f"{workload['metadata']['name']} runs `{' '.join([*path, *words])}`: esk has no command {words[0]!r}"
                command, path, words = sub, [*path, words[0]], words[1:]
            command.make_context(" ".join(path), words)  # click.UsageError: an option or argument it does not take


def test_each_subscriber_runs_a_subscription_and_a_sqlite_one_keeps_its_file() -> None:
    subscriptions = configured_subscriptions(Settings(_env_file=None))  # the repository's, as the image holds them
    documents = manifests("base")
    settings = config_map(documents)
    subscribers = [w for w in workloads(documents) if pod_spec(w)["containers"][0]["args"][0] == "subscriber"]
    assert subscribers
    for workload in subscribers:
        name = pod_spec(workload)["containers"][0]["args"][1]
        assert name in subscriptions, f"{workload['metadata']['name']} runs {name!r}: no such subscription"
        subscription = subscriptions[name]
        if isinstance(subscription, DatabaseHandler) and (subscription.database is None or isinstance(subscription.database, SQLite)):
            # Its SQLite file holds its table and its offsets: one pod, one volume that outlives it.
            assert (workload["kind"], workload["spec"]["replicas"]) == ("StatefulSet", 1)
            kind, _ = mount_of(workload, pod_spec(workload)["containers"][0], settings["ESK_SUBSCRIBER__DATA_DIR"])
            assert kind == "claim"


def setting_names(model: type[BaseModel], prefix: str, delimiter: str) -> set[str]:
    names: set[str] = set()
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names |= setting_names(field.annotation, f"{prefix}{name.upper()}{delimiter}", delimiter)
        else:
            names.add(f"{prefix}{name.upper()}")
    return names


def test_every_esk_variable_is_a_setting_and_its_value_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    valid = setting_names(Settings, Settings.model_config["env_prefix"] or "", Settings.model_config["env_nested_delimiter"] or "")
    valid.add(CACHE_DIR_VARIABLE)
    for name in KUSTOMIZATIONS:
        documents = manifests(name)
        env = {**dockerfile_env(), **config_map(documents), **secret(documents)}
        for workload in workloads(documents):
            for container in containers(workload):
                env |= {e["name"]: e.get("value", "") for e in container.get("env", [])}
        named = {n for n in env if n.startswith("ESK_")}
        assert named - valid == set(), f"not esk settings: {sorted(named - valid)}"
        for variable in list(os.environ):
            if variable.startswith("ESK_"):
                monkeypatch.delenv(variable)
        for variable in named:
            monkeypatch.setenv(variable, env[variable])
        settings = Settings(_env_file=None)  # a value of the wrong type fails here
        assert (settings.topics.replication_factor, settings.topics.min_insync_replicas) == (3, 2)
        assert settings.processor.metrics_host == settings.api.host == settings.subscriber.metrics_host == "0.0.0.0"
        assert settings.kafka.bootstrap_servers is not None, "the embedded broker is not for a cluster"
        assert settings.api.auth_tokens, "authentication on"


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_pods_run_as_the_image_user(name: str) -> None:
    run = " ".join(dockerfile_args("RUN"))
    uid = int(found(r"useradd\b[^&;]*--uid (\d+)", run)[1])
    gid = int(found(r"groupadd\b[^&;]*--gid (\d+)", run)[1])
    assert re.search(rf"useradd\b[^&;]*--gid {gid}\b", run), "the user's primary group is the one made for it"
    assert dockerfile_args("USER") == [f"{uid}:{gid}"], "numeric, so that runAsNonRoot can be checked"
    for workload in workloads(manifests(name)):
        context = pod_spec(workload)["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"], context.get("fsGroup", gid)) == (uid, gid, gid), workload["metadata"]["name"]
        for container in containers(workload):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def port(container: Manifest, name: str) -> int:
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(number)


def test_ports_match_the_settings_and_the_image() -> None:
    documents = manifests("base")
    settings = config_map(documents)
    defaults = Settings(_env_file=None)
    [api] = component(documents, "api")["spec"]["template"]["spec"]["containers"]
    [processor] = component(documents, "processor")["spec"]["template"]["spec"]["containers"]
    [subscriber] = component(documents, "subscriber")["spec"]["template"]["spec"]["containers"]
    expected = {
        "api": (port(api, "http"), settings["ESK_API__PORT"], defaults.api.port, 8000),
        "processor": (port(processor, "metrics"), settings["ESK_PROCESSOR__METRICS_PORT"], defaults.processor.metrics_port, 9464),
        "subscriber": (port(subscriber, "metrics"), settings["ESK_SUBSCRIBER__METRICS_PORT"], defaults.subscriber.metrics_port, 9465),
    }
    for name, (container_port, configured, default, documented) in expected.items():
        assert container_port == int(configured) == default == documented, name
    exposed = {int(p) for args in dockerfile_args("EXPOSE") for p in args.split()}
    assert exposed == {8000, 9464, 9465}
    for workload in workloads(documents):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if workload["kind"] == "Job":
            continue
        assert annotations["prometheus.io/scrape"] == "true"
        [container] = pod_spec(workload)["containers"]
        assert int(annotations["prometheus.io/port"]) in {int(p["containerPort"]) for p in container["ports"]}
        names = {p["name"] for p in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in names, f"{workload['metadata']['name']} {probe}"
    # the API waits for a broker before it answers: for minutes, not the liveness probe's
    # minute or so (the processor and the subscribers answer /healthz as they wait)
    startup = component(documents, "api")["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz" and startup["periodSeconds"] * startup["failureThreshold"] >= 600
    for service in (m for m in documents if m["kind"] == "Service"):
        selected = [w for w in workloads(documents) if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for workload in selected:
            names = {p["name"] for c in containers(workload) for p in c.get("ports", [])}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def mount_of(workload: Manifest, container: Manifest, path: str) -> tuple[str, Manifest]:
    """The volume `path` lies on in `container`: ("claim", template) or ("pod", volume)."""
    mounts = [m for m in container["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of {workload['metadata']['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    claims = {t["metadata"]["name"]: t for t in workload["spec"].get("volumeClaimTemplates", [])}
    if mount["name"] in claims:
        return "claim", claims[mount["name"]]
    [volume] = [v for v in pod_spec(workload).get("volumes", []) if v["name"] == mount["name"]]
    return "pod", volume


def test_state_lives_on_the_right_volumes() -> None:
    documents = manifests("base")
    settings = config_map(documents)
    processor = component(documents, "processor")
    kind, _ = mount_of(processor, pod_spec(processor)["containers"][0], settings["ESK_PROCESSOR__STATE_DIR"])
    assert kind == "claim", "the processor's stores outlive the pod: a restart is warm"
    api = component(documents, "api")
    kind, volume = mount_of(api, pod_spec(api)["containers"][0], settings["ESK_API__STATE_DIR"])
    assert kind == "pod" and "emptyDir" in volume, "each API replica rebuilds its own from the changelog"
    for name in KUSTOMIZATIONS:
        for workload in workloads(manifests(name)):
            for container in containers(workload):
                if container["securityContext"].get("readOnlyRootFilesystem"):  # Spark's scratch space too
                    kind, volume = mount_of(workload, container, "/tmp")
                    assert kind == "pod" and "emptyDir" in volume, f"{workload['metadata']['name']}: /tmp"


def test_the_read_models_write_the_warehouse_that_every_api_pod_reads() -> None:
    documents = manifests("example")
    warehouse = config_map(documents)["ESK_PROJECTIONS__WAREHOUSE_DIR"]
    assert warehouse == dockerfile_env()["ESK_PROJECTIONS__WAREHOUSE_DIR"], "the image's default and the deployment's agree"
    claims = {m["metadata"]["name"]: m for m in documents if m["kind"] == "PersistentVolumeClaim"}
    read_models, api = component(documents, "read-models"), component(documents, "api")
    mounted = {}
    for workload in (read_models, api):
        [container] = pod_spec(workload)["containers"]
        kind, volume = mount_of(workload, container, warehouse)
        assert kind == "pod" and "persistentVolumeClaim" in volume, f"{workload['metadata']['name']}: the warehouse on a claim"
        [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        mounted[workload["metadata"]["labels"]["app.kubernetes.io/component"]] = (volume["persistentVolumeClaim"]["claimName"], mount.get("readOnly", False))
    [claim] = {name for name, _ in mounted.values()}
    assert mounted == {"read-models": (claim, False), "api": (claim, True)}, "one writer; the API reads"
    assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], "the driver's pod and every API pod mount it at once"
    # one driver, even when a node is lost: a table has one writer, a checkpoint one query
    assert (read_models["kind"], read_models["spec"]["replicas"]) == ("StatefulSet", 1)
    assert all(m["metadata"]["labels"]["app.kubernetes.io/part-of"] == "esk" for m in documents if m["kind"] != "Namespace")
    assert read_models["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60, "the batch in flight ends at a stop"
    assert configured_read_models(Settings(_env_file=None)), "the image's project declares read models (ESK_READ_MODELS)"


def test_the_read_models_memory_covers_the_driver() -> None:
    documents = manifests("example")
    driver = config_map(documents).get("ESK_PROJECTIONS__DRIVER_MEMORY", Settings(_env_file=None).projections.driver_memory)
    number, unit = found(r"^(\d+)([kmgt])b?$", driver.lower()).groups()  # the JVM's -Xmx form
    heap = int(number) * 1024 ** "kmgt".index(unit) / 1024
    resources = pod_spec(component(documents, "read-models"))["containers"][0]["resources"]
    limit = mebibytes(resources["limits"]["memory"])
    # the heap, plus the JVM's own memory, Python, and the upcasters' Python workers
    assert limit >= heap + 768, resources
    assert mebibytes(resources["requests"]["memory"]) == limit


def mebibytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    number, unit = found(r"^(\d+(?:\.\d+)?)([KMG]i?)?$", quantity).groups()
    return float(number) * units.get(unit or "", 1) / 2**20


def test_the_processor_memory_covers_its_budget() -> None:
    documents = manifests("base")
    budget = int(config_map(documents)["ESK_PROCESSOR__MEMORY_BUDGET_MB"])
    resources = pod_spec(component(documents, "processor"))["containers"][0]["resources"]
    limit = mebibytes(resources["limits"]["memory"])
    # G7: the process measured the budget plus 69 to 113 MB.
    assert limit >= budget + 128, f"memory limit {resources['limits']['memory']} for a budget of {budget} MB"
    assert mebibytes(resources["requests"]["memory"]) == limit


def test_the_image_holds_what_the_manifests_run() -> None:
    copies = [shlex.split(args) for args in dockerfile_args("COPY")]
    assert ["domain", "domain"] in copies, "the example domain (ESK_DOMAIN)"
    if (ROOT / "subscriptions").is_dir():
        assert ["subscriptions", "subscriptions"] in copies, "the example's subscriptions (ESK_SUBSCRIPTIONS): COPY subscriptions subscriptions"
    assert ["projections", "projections"] in copies, "the example's read models (ESK_READ_MODELS)"
    assert ["esk.lock.json", "./"] in copies, "the schema lock, which the processor checks the code against as it starts"
    env = dockerfile_env()
    jars = {Path(c[1]).parent.name: c[-1] for c in copies if c[0] == "--from=jars"}
    assert jars == {"kafka": env["ESK_BROKER__JARS_DIR"], "spark": env["ESK_PROJECTIONS__JARS_DIR"]}
    jar_stage = DOCKERFILE.read_text().split("AS jars", 1)[1].split("\nFROM ", 1)[0]
    sources = [source for line in re.findall(r"^COPY (.+)$", jar_stage, re.M) for source in line.split()[:-1]]
    assert {Path(source).parent.name for source in sources} == {"kafka", "spark"}
    for source in sources:
        assert (ROOT / source).is_file(), f"{source}: the jars are resolved from the Maven files the package ships"
    assert re.search(r"pip install [^&]*\[spark\]", " ".join(dockerfile_args("RUN"))), "PySpark and delta-rs: the spark extra"


def test_the_overlay_sets_namespace_image_and_settings() -> None:
    base, example = manifests("base"), manifests("example")
    assert all("namespace" not in m["metadata"] for m in base), "the base leaves the namespace to overlays"
    [namespace] = [m["metadata"]["name"] for m in example if m["kind"] == "Namespace"]
    assert all(m["metadata"].get("namespace") == namespace for m in example if m["kind"] != "Namespace")
    images = {c["image"] for w in workloads(example) for c in containers(w)}
    assert len(images) == 1 and images != {"esk"} and ":" in images.pop()
    settings = config_map(example)
    assert settings["ESK_APP"] != config_map(base)["ESK_APP"]
    assert settings["ESK_TOPICS__REPLICATION_FACTOR"] == "3", "merged with the base's settings, not instead of them"
    [generated] = [m["metadata"]["name"] for m in example if m["kind"] == "ConfigMap"]
    for workload in workloads(example):
        for container in containers(workload):
            assert {"configMapRef": {"name": generated}} in container["envFrom"]
            assert {"secretRef": {"name": "esk-secrets"}} in container["envFrom"]
