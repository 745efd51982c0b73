# The MLflow tracking server with what a Postgres backend and an S3 artifact store need
# (the upstream image has neither psycopg2 nor boto3).
FROM python:3.11-slim
RUN pip install --no-cache-dir "mlflow==3.17.2" "psycopg2-binary>=2.9,<3" "boto3>=1.34,<2"
EXPOSE 5000
