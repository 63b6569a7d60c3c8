# Two commands matter: `make run` and `make test`. Both set everything up first;
# a second run reuses the virtual environment and the jar cache.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
ESK    := $(VENV)/bin/esk
VENV_STAMP := $(VENV)/.esk-installed
KAFKA_JARS := deploy/kafka/libs/.resolved
SPARK_JARS := deploy/spark/jars/.resolved

.PHONY: run test setup venv jars tools crash bench bench-quick clean

setup: venv jars

venv: $(VENV_STAMP)
$(VENV_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found: install Python 3.11+ (apt-get install python3 python3-venv)"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: esk needs Python 3.11+, $(PYTHON) is $$($(PYTHON) --version)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "error: could not create $(VENV): apt-get install python3-venv"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,spark]'
	@touch $@

jars: $(KAFKA_JARS) $(SPARK_JARS)
tools:
	@command -v java >/dev/null 2>&1 || { echo "error: java not found: install OpenJDK 17+ (apt-get install openjdk-17-jre-headless)"; exit 1; }
	@command -v mvn >/dev/null 2>&1 || { echo "error: mvn not found: install Maven (apt-get install maven)"; exit 1; }

$(KAFKA_JARS): deploy/kafka/pom.xml | tools
	rm -rf deploy/kafka/libs
	mvn -q -B -f deploy/kafka/pom.xml dependency:copy-dependencies
	@touch $@

$(SPARK_JARS): deploy/spark/pom.xml deploy/spark/maven-settings.xml | tools
	rm -rf deploy/spark/jars
	mvn -q -B -s deploy/spark/maven-settings.xml -f deploy/spark/pom.xml dependency:copy-dependencies
	@touch $@

run: setup
	$(ESK) dev

test: setup
	$(PY) -m pytest -p no:cacheprovider

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

clean:
	rm -rf $(VENV) deploy/kafka/libs deploy/spark/jars .esk
