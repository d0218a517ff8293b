#!/usr/bin/env bash
# Fuzz the HTTP request parsers and the framing check on request heads
# (fuzz/fuzz_request.c) with libFuzzer under
# AddressSanitizer and UndefinedBehaviorSanitizer for FUZZ_SECONDS (default 60).
# Seeds come from fuzz/corpus/ (never modified); new inputs go to
# $FUZZ_BUILD/corpus. Installs clang from Debian when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${FUZZ_BUILD:-build-fuzz}
SECONDS_TO_RUN=${FUZZ_SECONDS:-60}
JOBS=${JOBS:-2}

if ! command -v clang >/dev/null 2>&1; then
    echo "installing: clang"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends clang
fi

# The library, instrumented for coverage (no fuzzer main: that comes with the target).
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DRAGKV_WERROR=OFF \
    -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link $SAN" >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target ragkv_core
LIBS="$(pkg-config --libs jansson libpcre2-8 sqlite3 openblas hiredis libcrypto) -lxxhash -lcivetweb -lpthread -lm"
# shellcheck disable=SC2086
clang -g -O1 -D_GNU_SOURCE -I. $(pkg-config --cflags jansson) -fsanitize=fuzzer $SAN \
    fuzz/fuzz_request.c "$BUILD/libragkv_core.a" $LIBS -o "$BUILD/fuzz_request"

mkdir -p "$BUILD/corpus"
echo "fuzzing the request parsers for ${SECONDS_TO_RUN} s"
"$BUILD/fuzz_request" -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -timeout=10 \
    -dict=fuzz/request.dict -print_final_stats=1 "$BUILD/corpus" fuzz/corpus
