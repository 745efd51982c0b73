"""Prefect tasks: one per stage call, with the shared machinery around it (fingerprint caching by
committed manifest, an MLflow nested run per task, Prefect artifacts, retries)."""
