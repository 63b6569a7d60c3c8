# esk: one image for `esk api` and `esk processor` (and `esk dev` with the embedded broker).
# Build from the repository root: docker build -t esk .
FROM maven:3.9-eclipse-temurin-17 AS jars
WORKDIR /build
COPY deploy/kafka/pom.xml deploy/kafka/pom.xml
RUN mvn -q -B -f deploy/kafka/pom.xml dependency:copy-dependencies

FROM python:3.11-slim-bookworm
# Java only serves the embedded broker of `esk dev`; api and processor never start a JVM.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 esk
WORKDIR /opt/esk
COPY pyproject.toml README.md ./
COPY app app
COPY domain domain
COPY projections projections
RUN pip install --no-cache-dir .
COPY --from=jars /build/deploy/kafka/libs deploy/kafka/libs
ENV ESK_BROKER__JARS_DIR=/opt/esk/deploy/kafka/libs \
    ESK_PROCESSOR__STATE_DIR=/var/lib/esk/processor \
    ESK_API__STATE_DIR=/var/lib/esk/api \
    ESK_API__HOST=0.0.0.0
RUN mkdir -p /var/lib/esk && chown esk /var/lib/esk
USER esk
VOLUME /var/lib/esk
EXPOSE 8000 9464
ENTRYPOINT ["esk"]
CMD ["api"]
