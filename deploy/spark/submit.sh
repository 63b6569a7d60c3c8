#!/usr/bin/env bash
# Run an esk projection on a Spark cluster with spark-submit.
#   deploy/spark/submit.sh spark://spark-master:7077 customer_recent_orders --continuous
# Needs: `make jars` (deploy/spark/jars), the same Python packages on the executors
# (pip install 'esk[spark]'), ESK_* settings exported (Kafka, ESK_PROJECTIONS__WAREHOUSE_DIR
# on storage every node sees, e.g. s3a:// or a shared mount).
set -euo pipefail
master=$1; shift
root=$(cd "$(dirname "$0")/../.." && pwd)
jars=$(ls "$root"/deploy/spark/jars/{spark-sql-kafka,spark-token-provider-kafka,kafka-clients,commons-pool2,delta-spark,delta-storage}*.jar | paste -sd, -)
bundle=$(mktemp -d)/esk.zip
(cd "$root" && zip -qr "$bundle" app domain projections -x '*/__pycache__/*')
exec spark-submit --master "$master" --jars "$jars" --py-files "$bundle" \
  --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension \
  --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog \
  "$root/projections/job.py" "$@"
