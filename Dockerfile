# The brain's image: `make image` builds it with docker, podman or buildah (deploy/image.sh).
# BASE is any Debian-like image with python3 (>= 3.11) and its venv module; `make image` without BASE makes
# one from the Debian mirror with mmdebstrap where no registry image can be pulled.
ARG BASE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE} AS build
COPY . /src
# Installed here, once: the running image never calls pip. deploy/image.sh puts the wheels in build/wheels
# first (with the host's own index and CA settings), so the build needs no network; without them pip
# fetches from its index.
RUN python3 -m venv /opt/warmroute \
 && if [ -d /src/build/wheels ]; then src="--no-index --find-links /src/build/wheels warmroute[kubernetes]"; \
    else src="/src[kubernetes]"; fi \
 && /opt/warmroute/bin/pip install --no-cache-dir --disable-pip-version-check $src \
 && /opt/warmroute/bin/warmroute --help >/dev/null

FROM ${BASE}
COPY --from=build /opt/warmroute /opt/warmroute
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin warmroute
ENV PATH=/opt/warmroute/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
# 9002: gRPC (ext_proc / endpoint picker, health), the port gateways use for pickers; 9102: /metrics
EXPOSE 9002 9102
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
  CMD ["warmroute", "health", "--target", "127.0.0.1:9002", "--service", "liveness"]
ENTRYPOINT ["warmroute", "brain", "--config", "/etc/warmroute/warmroute.yaml"]
