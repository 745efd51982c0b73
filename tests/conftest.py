"""Test-suite wiring: shared fixtures (local S3 endpoint, MLflow server, tiny checkpoints) and an
isolated environment so tests never touch ~/.prefect, ./mlruns or the user's work dir."""

import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(ROOT))

# Isolation first, before any test module imports prefect or mlflow.
_STATE = tempfile.mkdtemp(prefix="eightfold-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_STATE, "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_STATE}/mlflow.db")

pytest_plugins = []
for _name in ("s3", "mlflow_server", "tiny_hf", "slurm", "prefect", "k8s", "scheduling"):
    if (pathlib.Path(__file__).parent / "fixtures" / f"{_name}.py").exists():
        pytest_plugins.append(f"fixtures.{_name}")

import pytest  # noqa: E402

# Variables a test may point elsewhere (work dir, tracking, Prefect API, fault drills). Whatever a
# module does to them, the next module starts from the session's values.
_SCOPED_ENV = ("EIGHTFOLD_WORKDIR", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "EIGHTFOLD_FAULT_FAIL_STAGE",
               "EIGHTFOLD_FAULT_ONCE_FILE")
_SESSION_ENV = {k: os.environ.get(k) for k in _SCOPED_ENV}


@pytest.fixture(autouse=True, scope="module")
def _restore_scoped_env():
    yield
    for key, value in _SESSION_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
