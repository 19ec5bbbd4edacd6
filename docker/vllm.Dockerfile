# vLLM's official image with the batchlens plugin, for the compose `gpu` profile and for Kubernetes
# (docs/kubernetes.md). Build argument VLLM_IMAGE: the vLLM image to add the plugin to.
# VLLM_PLUGINS=batchlens (below) and BATCHLENS_ADMIN_TOKEN (the pod's or compose's) switch the admin API on.
# Stage 1 builds the batchlens wheel; vLLM's image installs only that wheel, as the docs tell users to.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${VLLM_IMAGE}
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir /tmp/dist/batchlens-*.whl && rm -rf /tmp/dist
# Both halves of the plugin: the admin API's routes (an endpoint plugin, loaded only when named here) and the
# engine side (a general plugin); docs/vllm-plugin.md.
ENV VLLM_PLUGINS=batchlens
