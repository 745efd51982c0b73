# The MLflow tracking server with what a Postgres backend and an S3 artifact store need
# (the upstream image has neither a Postgres driver nor boto3). psycopg 3: SQLAlchemy 2.1, which
# mlflow 3.17 resolves to, maps `postgresql://` to it (tests/flows/test_full_lifecycle.py found that).
FROM python:3.11-slim
RUN pip install --no-cache-dir "mlflow==3.17.2" "psycopg[binary]>=3.1,<4" "boto3>=1.34,<2"
EXPOSE 5000
