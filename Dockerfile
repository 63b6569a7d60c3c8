# esk: one image for `esk api`, `esk processor` and `esk topics init` (and `esk dev` with the
# embedded broker), running the example domain; a user's image is the same with their own
# code copied in place of domain/ and projections/. Build from the repository root:
#   docker build -t esk .
FROM python:3.11-slim-bookworm AS wheel
WORKDIR /build
COPY pyproject.toml README.md ./
COPY app app
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM maven:3.9-eclipse-temurin-17 AS jars
# The same poms the wheel carries; resolved here so the image never reaches Maven Central.
COPY app/esk/jars/kafka/pom.xml /build/kafka/pom.xml
RUN mvn -q -B -f /build/kafka/pom.xml dependency:copy-dependencies

FROM python:3.11-slim-bookworm
# Java only serves the embedded broker of `esk dev`; api and processor never start a JVM.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 esk
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY --from=jars /build/kafka/jars /opt/esk/jars/kafka
# The user's code: esk imports it from the working directory (ESK_DOMAIN, ESK_READ_MODELS).
WORKDIR /opt/esk/app
COPY domain domain
ENV ESK_BROKER__JARS_DIR=/opt/esk/jars/kafka \
    ESK_BROKER__DATA_DIR=/var/lib/esk/broker \
    ESK_PROCESSOR__STATE_DIR=/var/lib/esk/processor \
    ESK_API__STATE_DIR=/var/lib/esk/api \
    ESK_API__HOST=0.0.0.0 \
    ESK_PROCESSOR__METRICS_HOST=0.0.0.0
RUN mkdir -p /var/lib/esk && chown esk /var/lib/esk
USER esk
VOLUME /var/lib/esk
EXPOSE 8000 9464
ENTRYPOINT ["esk"]
CMD ["api"]
