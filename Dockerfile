# esk: one image for everything deploy/k8s/ runs (`esk api`, `esk processor`, `esk topics
# init`, `esk subscriber NAME`, `esk project run --all --continuous`) and for `esk dev` with
# the embedded broker, running the example's domain, subscriptions and read models; a user's
# image is the same with their own code copied in place of domain/, subscriptions/ and
# projections/.
# tests/deploy/test_k8s_manifests.py holds deploy/k8s/ to this file (user, ports, settings,
# entrypoint). Build from the repository root:
#   docker build -t esk .
FROM python:3.11-slim-bookworm AS wheel
WORKDIR /build
COPY pyproject.toml README.md ./
COPY app app
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM maven:3.9-eclipse-temurin-17 AS jars
# The same pom the wheel carries; resolved here so the image never reaches Maven Central.
# Its copy-dependencies writes to jars/ beside the pom.
COPY app/esk/jars/kafka/pom.xml /build/kafka/pom.xml
RUN mvn -q -B -f /build/kafka/pom.xml dependency:copy-dependencies
# Spark's Kafka source and Delta Lake (pyspark's wheel carries Spark itself), from Maven
# Central alone (maven-settings.xml), as `esk jars spark` resolves them.
COPY app/esk/jars/spark/pom.xml app/esk/jars/spark/maven-settings.xml /build/spark/
RUN mvn -q -B -s /build/spark/maven-settings.xml -f /build/spark/pom.xml dependency:copy-dependencies

FROM python:3.11-slim-bookworm
# Java serves the embedded broker of `esk dev` and the read models' Spark driver; api,
# processor and subscribers never start a JVM. The slim image has no man directories, which
# Java's update-alternatives may link into. The user and group 10001 are the pods'
# runAsUser/runAsGroup/fsGroup.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 esk \
 && useradd --create-home --uid 10001 --gid 10001 esk
COPY --from=wheel /wheels /wheels
# With the spark extra: the read models' driver runs PySpark, and the API reads their
# tables with delta-rs.
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[spark]" && rm -rf /wheels
COPY --from=jars /build/kafka/jars /opt/esk/jars/kafka
COPY --from=jars /build/spark/jars /opt/esk/jars/spark
# The user's code: esk imports it from the working directory (ESK_DOMAIN, ESK_SUBSCRIPTIONS,
# ESK_READ_MODELS).
WORKDIR /opt/esk/app
COPY domain domain
COPY subscriptions subscriptions
COPY projections projections
# the schema lock: a processor refuses to start on code that would contradict the events
# stored under it (a project without one leaves this line out: the check is skipped)
COPY esk.lock.json ./
# Logs reach `kubectl logs` / `docker logs` as they are written, not when a buffer fills.
ENV PYTHONUNBUFFERED=1 \
    ESK_BROKER__JARS_DIR=/opt/esk/jars/kafka \
    ESK_PROJECTIONS__JARS_DIR=/opt/esk/jars/spark \
    ESK_CACHE_DIR=/opt/esk/cache \
    ESK_PROJECTIONS__WAREHOUSE_DIR=/var/lib/esk/warehouse \
    ESK_BROKER__DATA_DIR=/var/lib/esk/broker \
    ESK_PROCESSOR__STATE_DIR=/var/lib/esk/processor \
    ESK_API__STATE_DIR=/var/lib/esk/api \
    ESK_SUBSCRIBER__DATA_DIR=/var/lib/esk/subscriptions \
    ESK_API__HOST=0.0.0.0 \
    ESK_PROCESSOR__METRICS_HOST=0.0.0.0 \
    ESK_SUBSCRIBER__METRICS_HOST=0.0.0.0
# The local Spark driver's class archive (esk/projections/class_archive.py) for this image's
# Java and jars, made once here (a Spark session, about a minute; ~190 MB): a one-shot `esk
# project run` or `esk sql` then starts seconds sooner. Read-only at run time; nothing else
# is written to ESK_CACHE_DIR when the jars' folders are set, as they are above. Its session
# gets a warehouse of its own (the image's belongs to the user it runs as), and a build
# without the archive fails rather than ship without it.
RUN ESK_PROJECTIONS__WAREHOUSE_DIR=/tmp/esk-archive-warehouse esk jars spark >/dev/null \
 && ls /opt/esk/cache/class-archives/*.jsa >/dev/null \
 && rm -rf /tmp/esk-archive-warehouse
RUN mkdir -p /var/lib/esk && chown 10001:10001 /var/lib/esk
# Numeric, so that Kubernetes' runAsNonRoot can tell it is not root.
USER 10001:10001
VOLUME /var/lib/esk
# The API; the processor's metrics; a subscriber's metrics.
EXPOSE 8000 9464 9465
ENTRYPOINT ["esk"]
CMD ["api"]
