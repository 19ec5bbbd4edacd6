# One slim image for batchlens: exporter, remediate, simulate and load (the command picks).
# Stage 1 builds the wheel; stage 2 installs only that wheel, so the image runs what users install.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/batchlens batchlens \
    && mkdir /var/lib/batchlens/state && chown batchlens /var/lib/batchlens/state   # a new volume copies this owner
COPY --from=wheel /dist /tmp/dist
# The kubernetes extra: grpcio for the kubelet's pod-resources API (the Helm chart's exporter uses it).
RUN pip install --no-cache-dir "$(echo /tmp/dist/batchlens-*.whl)[kubernetes]" && rm -rf /tmp/dist /root/.cache

USER batchlens
WORKDIR /var/lib/batchlens
# Each compose service points this at its own /healthz (or /health for the simulator).
ENV BATCHLENS_HEALTH_URL=http://127.0.0.1:9400/healthz
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['BATCHLENS_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["batchlens"]
CMD ["--help"]
