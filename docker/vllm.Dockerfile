# vLLM's official image with the batchlens plugin, for the compose `gpu` profile.
# VLLM_PLUGINS=batchlens and BATCHLENS_ADMIN_TOKEN (set in docker-compose.yml) switch the admin API on.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /opt/batchlens/
COPY src /opt/batchlens/src
RUN pip install --no-cache-dir /opt/batchlens
