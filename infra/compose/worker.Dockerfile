# A Prefect worker that runs eightfold's flows: this checkout installed at /opt/eightfold, so the
# deployments that `eightfold deploy` registers inside this image find their code at the same path.
# Build context: the repository root (see docker-compose.yml).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends git build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/eightfold
# torch first and pinned, as in the Makefile; the CPU wheel unless TORCH_INDEX names a CUDA one.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY flows flows
COPY tasks tasks
COPY stages stages
COPY trainer trainer
COPY infra infra
COPY benchmarks benchmarks
COPY configs configs
COPY prefect.yaml Makefile ./
RUN pip install --no-cache-dir -e .
ENV PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
CMD ["prefect", "worker", "start", "--pool", "eightfold-process", "--type", "process"]
