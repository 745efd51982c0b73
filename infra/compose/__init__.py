"""A team's shared services as a Docker Compose file (not Python): Prefect server on Postgres, an
MLflow server whose artifacts live in S3 (MinIO), the MinIO object store that also holds the stage
artifacts, and a Prefect process worker built from this project. README "Team set-up" explains it."""
