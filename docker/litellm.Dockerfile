# The LiteLLM proxy with the batchlens routing plugin (docs/routing.md), for docker compose.
# Stage 1 builds the batchlens wheel; stage 2 installs the LiteLLM release the plugin targets, then the wheel
# constrained by what LiteLLM installed (as scripts/litellm-env.sh does), so LiteLLM's pins never move.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.11-slim
ARG LITELLM_VERSION=1.106.12
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/batchlens batchlens
RUN pip install --no-cache-dir "litellm[proxy]==${LITELLM_VERSION}" && pip freeze > /tmp/constraints.txt
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir /tmp/dist/batchlens-*.whl --constraint /tmp/constraints.txt \
    && rm -rf /tmp/dist /tmp/constraints.txt /root/.cache
USER batchlens
WORKDIR /var/lib/batchlens
# LiteLLM would fetch its model cost map from GitHub at every start; its own copy serves.
ENV LITELLM_LOCAL_MODEL_COST_MAP=True
EXPOSE 4000
# `batchlens build` writes the proxy's config from the batchlens config the plugin reads too (BATCHLENS_CONFIG):
# one source, here as in a checkout.
ENTRYPOINT ["/bin/sh", "-ec", "batchlens build --config \"$BATCHLENS_CONFIG\" --root /tmp/batchlens > /dev/null && exec litellm --config /tmp/batchlens/routing/litellm-config.yaml --host 0.0.0.0 --port 4000 --num_workers 1 --keepalive_timeout 75 \"$@\"", "litellm"]
