# The one image the operator (`tokenkeep operator`) and the session servers (`tokenkeep serve`)
# run from. Build:  docker build -t <registry>/tokenkeep:0.1.0 .
# vLLM itself runs from the official vLLM image (ModelServer spec.engine.image).

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY session_server ./session_server
COPY tokenkeep ./tokenkeep
COPY operator ./operator
# The image installs the same wheel, with runtime dependencies only, that
# tests/packaging/test_wheel.py builds, installs into a clean virtualenv and serves from.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/tokenkeep-*.whl && rm -rf /wheels \
    && groupadd --gid 10001 tokenkeep \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent tokenkeep \
    && mkdir -p /cache && chown 10001:10001 /cache
# Numeric, so that Kubernetes can verify runAsNonRoot.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["tokenkeep"]
CMD ["serve"]
