-- One Postgres, two databases: Prefect's orchestration state and MLflow's runs/metrics.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
