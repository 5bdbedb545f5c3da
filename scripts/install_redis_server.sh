#!/usr/bin/env bash
# The KV-store tests start their own redis-server (Debian's package) on a free port; install it
# when it is missing, so that `make test` passes on a fresh machine.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
command -v redis-server >/dev/null
