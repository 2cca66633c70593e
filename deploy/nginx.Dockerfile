# The scale profile's load balancer: Debian's nginx, and envsubst to render the repo's config
# (docker-compose.yml mounts deploy/nginx.conf.template and runs both). A file, not compose's
# dockerfile_inline, which only Compose v2 reads: Debian's docker-compose 1.29 refuses it.
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends nginx gettext-base \
    && rm -rf /var/lib/apt/lists/*
