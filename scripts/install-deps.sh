#!/usr/bin/env bash
# Install ragkv's build dependencies from Debian packages, only what is missing.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libcivetweb-dev libjansson-dev libxxhash-dev libhiredis-dev libssl-dev redis-server
      libsqlite3-dev libcriterion-dev libopenblas-dev libpcre2-dev clang-format curl python3
      prometheus # prometheus: for promtool, which checks the /metrics exposition in the tests
      haproxy python3-yaml) # tests/test_cluster.c: replicas behind HAProxy, deploy/ files checked
# Node.js and npm: tests/test_openai.c installs the official openai npm SDK into build/npm
# and drives the server with it. npm is a package of its own only where nodejs lacks it.
pkgs+=(nodejs)
command -v npm >/dev/null 2>&1 || pkgs+=(npm)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
