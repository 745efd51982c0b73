"""Prefect flows (the lifecycle, one flow per stage, deployments) and the `eightfold` CLI."""
