#!/usr/bin/env bash
# Run an esk read model on a Spark cluster with spark-submit, from the user's project
# directory (where ESK_DOMAIN and ESK_READ_MODELS find the user's modules):
#   deploy/spark/submit.sh spark://spark-master:7077 customer_recent_orders --continuous
# Needs: esk installed with the spark extra here and on the executors (pip install 'esk[spark]'),
# ESK_* settings exported (Kafka; ESK_PROJECTIONS__WAREHOUSE_DIR on storage every node sees,
# e.g. s3a:// or a shared mount). The user's packages named by ESK_DOMAIN and ESK_READ_MODELS
# travel to the executors in a zip; ESK_SUBMIT_PACKAGES overrides which (default: domain projections).
set -euo pipefail
master=$1; shift
jars_dir=$(esk jars spark)
jars=$(ls "$jars_dir"/{spark-sql-kafka,spark-token-provider-kafka,kafka-clients,commons-pool2,delta-spark,delta-storage}*.jar | paste -sd, -)
job=$(python -c 'import esk.projections.job as job; print(job.__file__)')
bundle=$(mktemp -d)/user.zip
zip -qr "$bundle" ${ESK_SUBMIT_PACKAGES:-domain projections} -x '*/__pycache__/*'
exec spark-submit --master "$master" --jars "$jars" --py-files "$bundle" \
  --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension \
  --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog \
  "$job" "$@"
