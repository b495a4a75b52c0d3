# The image every service of docker-compose.yml runs: Python, a Java runtime for Spark, and
# this project installed with its Spark and chaos extras. Spark itself comes with the
# pyspark package; SPARK_HOME points at it, as in the local chaos suite.
FROM python:3.11-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/stateful-async
COPY pyproject.toml README.md ./
COPY stateful_async ./stateful_async
COPY checkpoint ./checkpoint
RUN pip install --no-cache-dir ".[spark,chaos]" \
    && ln -s "$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" /opt/spark

ENV SPARK_HOME=/opt/spark \
    PATH=/opt/spark/bin:$PATH \
    PYSPARK_PYTHON=python3 \
    PYTHONUNBUFFERED=1
