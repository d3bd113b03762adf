# One image for the gateway and the worker (docker-compose.yml picks the command).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# g++: the worker builds its native attention kernel for the host's CPU at start-up (and inductor needs it
# for `compile`); without it attention runs on SDPA
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# the CPU build by default; a GPU worker's image takes a CUDA build of the same torch, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 -t specfleet:cuda .
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}
COPY pyproject.toml README.md ./
COPY shared shared
COPY gateway gateway
COPY workers workers
COPY configs configs
RUN pip install --no-cache-dir .
EXPOSE 8000
CMD ["specfleet", "--help"]
