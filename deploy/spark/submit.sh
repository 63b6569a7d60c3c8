#!/usr/bin/env bash
# Run esk read models on a Spark cluster with spark-submit (client mode: the driver runs
# here, the executors on the cluster's workers). From the user's project directory, where
# ESK_DOMAIN and ESK_READ_MODELS find the user's modules and .env is read:
#
#   deploy/spark/submit.sh spark://spark-master:7077 (NAME... | --all) [--continuous] [--rebuild]
#
# - The ESK_* settings are the driver's, as for `esk project run`; the warehouse and its
#   checkpoints (ESK_PROJECTIONS__WAREHOUSE_DIR) must be a path that every worker and this
#   machine see at the same name: deploy/spark/README.md.
# - PYSPARK_PYTHON (default python3) runs the driver and, unless spark.pyspark.python says
#   otherwise, the executors' Python workers: each needs esk's dependencies (pip install
#   'esk[spark]'), the same versions as here. The esk package and the user's packages named
#   by ESK_DOMAIN and ESK_READ_MODELS travel with the job (--py-files), so the executors run
#   this machine's code.
# - spark-submit is pyspark's own (or $SPARK_HOME's, which must be the same Spark version);
#   other Spark settings (executor memory, event log, ...) go in $SPARK_CONF_DIR/spark-defaults.conf.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 MASTER_URL (READ_MODEL... | --all) [--continuous] [--rebuild]" >&2
  exit 2
fi
master=$1; shift
export PYSPARK_PYTHON=${PYSPARK_PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The jars Spark needs beyond its own (Delta Lake, the Kafka source: what the local session
# loads, from the jar cache or ESK_PROJECTIONS__JARS_DIR), and a zip of the Python code the
# executors import: esk and the top-level packages of the user's domain and read models.
jars=$("$PYSPARK_PYTHON" - "$work/code.zip" <<'PY'
import importlib.util, sys, zipfile
from pathlib import Path

import esk
from esk.projections.session import extra_jars
from esk.settings import Settings

settings = Settings()
roots = {Path(esk.__file__).parent}
for spec in (settings.domain, settings.read_models):
    top = spec.partition(":")[0].split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None:
        sys.exit(f"submit.sh: no module {top!r} here (from {spec!r}); run it from the project's directory")
    roots.add(Path(found.submodule_search_locations[0]) if found.submodule_search_locations else Path(found.origin))
with zipfile.ZipFile(sys.argv[1], "w") as bundle:
    for root in roots:
        files = sorted(f for f in root.rglob("*") if f.is_file() and "__pycache__" not in f.parts) if root.is_dir() else [root]
        for file in files:
            bundle.write(file, file.relative_to(root.parent))
print(",".join(str(jar) for jar in extra_jars(settings.projections.jars_dir)))
PY
)
spark_home=${SPARK_HOME:-$("$PYSPARK_PYTHON" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')}
job=$("$PYSPARK_PYTHON" -c 'import esk.projections.job as job; print(job.__file__)')
"$spark_home/bin/spark-submit" --master "$master" --deploy-mode client \
  --jars "$jars" --py-files "$work/code.zip" "$job" "$@"
