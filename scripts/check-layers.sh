#!/usr/bin/env bash
# Fail when a folder includes a header from a folder above it in the layout
# (docs/architecture.md): dependencies point down only.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each folder and the folders it may include from (itself included).
declare -A may=(
    [config]="config"
    [kernels]="kernels config"
    [engine]="engine kernels config"
    [chunkcache]="chunkcache kernels config"
    [reindex]="reindex chunkcache kernels config"
    [store]="store config"
    [pipeline]="pipeline store reindex chunkcache engine kernels config"
    [gateway]="gateway pipeline store reindex chunkcache engine kernels config"
    [cli]="cli bench gateway pipeline store reindex chunkcache engine kernels config"
    [bench]="bench gateway pipeline store reindex chunkcache engine kernels config"
)
bad=0
for dir in "${!may[@]}"; do
    while IFS= read -r line; do
        file=${line%%:*}
        inc=$(sed -E 's/.*#include "([a-z_]+)\/.*/\1/' <<<"$line")
        if ! grep -qw "$inc" <<<"${may[$dir]}"; then
            echo "layering: $file includes from $inc/, which sits above $dir/"
            bad=1
        fi
    done < <(grep -rEn '^#include "[a-z_]+/' --include='*.c' --include='*.h' --include='*.cu' "$dir" || true)
done
[ $bad -eq 0 ] && echo "layers: ok"
# Inside a folder, data flows one way: no file calls a function defined in a
# file that calls it back (scripts/check-circles.py).
python3 scripts/check-circles.py pipeline gateway || bad=1
exit $bad
