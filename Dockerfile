# kvpool's image: `kvpool master`, `kvpool node` and `kvpool proxy` of
# deploy/compose/docker-compose.yml (which builds it), and every other kvpool command.
#
#   docker build -t kvpool:0.1.0 .                        # from the repository root
#   docker run --rm kvpool:0.1.0 --version
#
# BASE is any Debian bookworm image: Python and the libraries come from Debian's packages,
# so the image needs nothing but a Debian mirror and a Python package index.
# EXTRAS are the wheel's extras: `mooncake` (the default) adds real Mooncake as a pool
# engine (the non-CUDA wheel, over TCP); `--build-arg EXTRAS=` builds kvpool alone.
# vLLM is not in this image: kvpool goes into the vLLM image instead (docs/operations.md).
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS python
# libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4: Mooncake's wheel loads them at
# import, even over TCP (tests/deploy/test_image.py finds them with ldd).  They are here
# whatever EXTRAS says, so that one base serves both builds.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv \
        libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*
# /opt/kvpool is the venv that kvpool runs from; each stage that runs pip makes its own
ENV PATH=/opt/kvpool/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# The wheel is built in a stage of its own, so that the source tree stays out of the image.
FROM python AS wheel
COPY pyproject.toml README.md /src/
COPY kvpool /src/kvpool
RUN python3 -m venv /opt/kvpool \
    && pip wheel --no-cache-dir --no-deps --wheel-dir /dist /src

# Installed in a stage of its own, and only the environment copied on: a wheel copied into
# the image's own stage stays in that layer, though a later `rm` hides it.  (Not `RUN
# --mount=type=bind,from=wheel`: podman 4.3's buildah mounts nothing when that stage is
# cached.)
FROM python AS install
ARG EXTRAS=mooncake
COPY --from=wheel /dist /dist
RUN python3 -m venv /opt/kvpool \
    && pip install --no-cache-dir "$(echo /dist/kvpool-*.whl)${EXTRAS:+[$EXTRAS]}"

FROM python
COPY --from=install /opt/kvpool /opt/kvpool
RUN kvpool --version
# Root, as the Compose file needs it: the cluster secret is a host file of mode 600
# (kvpool refuses a wider one) that Compose mounts with its owner; the SSD tier is a host
# folder; with `ipc: host` vLLM's processes share /dev/shm.  Another user works once those
# belong to it: `user: "UID"` in Compose, `--user UID` here.
WORKDIR /workspace
ENTRYPOINT ["kvpool"]
CMD ["--help"]
