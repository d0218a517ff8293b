#!/usr/bin/env bash
# scripts/cuda-device-test.sh — build ragkv with the CUDA backend on a GPU
# machine that has nvcc, cuBLAS, CMake, ninja and compute-sanitizer but no
# Debian development packages and no network, run the CUDA tests (and the
# CPU kernel tests for reference), then compute-sanitizer's memcheck and
# racecheck on the CUDA tests. Logs go to $OUT (or build-cuda-device/logs).
#
# The build dependencies travel in .devdeps/ (ignored through
# .git/info/exclude, never committed). Three modes, all from the repo root:
#
#   bash scripts/cuda-device-test.sh --fetch
#       HERE, on the development machine (Debian bookworm, apt works):
#       `apt-get download`s the packages below into .devdeps/debs, copies
#       the shared test data (stories260K, the Qwen3 vocabulary) into
#       .devdeps/shared and adds /.devdeps/ to .git/info/exclude.
#   bash scripts/cuda-device-test.sh --selftest
#       HERE: unpacks .devdeps into a temporary prefix and configures, builds
#       and runs test_kernels (no CUDA) against it with the system's
#       library and pkg-config paths ignored, to prove the prefix is complete.
#   bash scripts/cuda-device-test.sh
#       THERE, on the GPU machine, with .devdeps carried (the device tool's
#       carry: [".devdeps"]): unpacks the packages with `dpkg -x` (or ar+tar)
#       into .devdeps/root — never into / — rewrites their pkg-config files
#       to that prefix, links the shared libraries the system lacks into
#       .devdeps/gaplib (system copies win where they exist), points
#       ../shared at .devdeps/shared when there is none, configures with
#       -DRAGKV_CUDA=ON, builds, tests and sanitizes, all within
#       RAGKV_DEVICE_BUDGET_S seconds (default 480; each step is cut to what
#       is left). RAGKV_DEVICE_QUICK=1: build and test_cuda only.
#       RAGKV_DEVICE_CMAKE_ARGS: more configure arguments (say
#       -DRAGKV_WERROR=OFF where that machine's newer compiler warns).
#
# Exit status: 0 when every step passed; otherwise the number of failed
# steps (each step's status is in summary.txt).
set -euo pipefail

ROOT=$(pwd)
[ -f "$ROOT/CMakeLists.txt" ] && [ -d "$ROOT/kernels" ] || {
    echo "run from the ragkv repository root" >&2
    exit 2
}
DEPS="$ROOT/.devdeps"
ARCH_TRIPLET=x86_64-linux-gnu

# Runtime libraries and build files ragkv's CMake needs, with the shared
# libraries they load (apt-cache depends, ldd): what a bare Ubuntu or Debian
# image with a C compiler may lack. pkgconf: in case there is no pkg-config.
PKGS=(libjansson-dev libjansson4 libcivetweb-dev libcivetweb1 libpcre2-dev libpcre2-8-0
      libxxhash-dev libxxhash0 libsqlite3-dev libsqlite3-0 libcriterion-dev libcriterion3
      libboxfort-dev libnanomsg5 libgit2-1.5 libhttp-parser2.9 libmbedtls14 libmbedx509-1
      libmbedcrypto7 libssh2-1 libopenblas-dev libopenblas0 libopenblas0-pthread
      libopenblas-pthread-dev libgfortran5 libquadmath0 libffi8 libssl3 libgssapi-krb5-2
      libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 zlib1g
      libhiredis-dev libhiredis0.14 pkgconf pkgconf-bin libpkgconf3)
SHARED_FILES=(models/stories260K.gguf models/stories260K.greedy200.txt
              tokenizers/qwen3/tokenizer.json)
for q in Q8_0 Q4_0 Q4_K_M Q5_K_M Q6_K; do # the quantized reference-text test
    SHARED_FILES+=("models/quantized/stories260K-wide-$q.gguf"
                   "models/quantized/stories260K-wide-$q.llamacpp200.txt")
done

step() { printf '\n==== %s [%s]\n' "$*" "$(date +%T)"; }

# ---------------------------------------------------------------- --fetch (here)

fetch() {
    step "downloading ${#PKGS[@]} packages into .devdeps/debs"
    mkdir -p "$DEPS/debs"
    (cd "$DEPS/debs" && rm -f ./*.deb && apt-get download "${PKGS[@]}")
    step "copying the shared test data into .devdeps/shared"
    local src
    src=$(cd "$ROOT/.." && pwd)/shared
    for f in "${SHARED_FILES[@]}"; do
        [ -f "$src/$f" ] || { echo "missing $src/$f" >&2; exit 1; }
        mkdir -p "$DEPS/shared/$(dirname "$f")"
        cp "$src/$f" "$DEPS/shared/$f"
    done
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.devdeps/' "$exclude" 2>/dev/null || echo '/.devdeps/' >>"$exclude"
    step "done"
    du -sh "$DEPS/debs" "$DEPS/shared"
    git status --short --ignored .devdeps | head -3
}

# ---------------------------------------------------------------- prefix

# Unpack every .deb of .devdeps/debs into $1 (a fresh prefix) and make its
# pkg-config files point there.
unpack() {
    local prefix=$1 deb
    rm -rf "$prefix"
    mkdir -p "$prefix"
    for deb in "$DEPS"/debs/*.deb; do
        if command -v dpkg-deb >/dev/null; then
            dpkg-deb -x "$deb" "$prefix"
        else
            local member
            member=$(ar t "$deb" | grep '^data\.tar')
            case "$member" in
            *.xz) ar p "$deb" "$member" | tar -xJ -C "$prefix" ;;
            *.zst) ar p "$deb" "$member" | zstd -dc | tar -x -C "$prefix" ;;
            *.gz) ar p "$deb" "$member" | tar -xz -C "$prefix" ;;
            *) ar p "$deb" "$member" | tar -x -C "$prefix" ;;
            esac
        fi
    done
    # Absolute /usr paths in .pc files -> the prefix. criterion.pc lists
    # Requires.private modules (libgit2, nanomsg, ...) whose -dev packages we
    # do not carry; they matter only for static linking: drop those lines.
    local pc
    while IFS= read -r -d '' pc; do
        sed -i -e "s#/usr/#$prefix/usr/#g" -e "s#=/usr\$#=$prefix/usr#" "$pc"
    done < <(find "$prefix" -name '*.pc' -print0)
    sed -i -e '/^Requires.private:/d' -e '/^Libs.private:/d' \
        "$prefix/usr/lib/$ARCH_TRIPLET/pkgconfig/criterion.pc"
}

# Link into $prefix/gaplib every carried shared library (lib*.so.N...) whose
# name the system's loader cache does not know (with all set: every one).
# Names that are not sonames (libx.so.4.14.0) land there too, unused.
make_gaplib() {
    local prefix=$1 all=${2:-} so name
    mkdir -p "$prefix/gaplib"
    local known
    known=$(ldconfig -p 2>/dev/null | awk '{print $1}' | sort -u || true)
    while IFS= read -r so; do
        name=$(basename "$so")
        if [ -n "$all" ] || ! grep -qxF "$name" <<<"$known"; then
            ln -sf "$so" "$prefix/gaplib/$name"
        fi
    done < <(find "$prefix/usr/lib/$ARCH_TRIPLET" "$prefix/lib/$ARCH_TRIPLET" \
                  -name 'lib*.so.[0-9]*' \( -type f -o -type l \) 2>/dev/null |
             grep -v '/openblas-openmp/\|/openblas-serial/')
}

# Environment for configuring, building and running against $1.
use_prefix() {
    local prefix=$1
    local pcdirs="$prefix/usr/lib/$ARCH_TRIPLET/pkgconfig:$prefix/usr/share/pkgconfig"
    pcdirs="$pcdirs:$prefix/usr/lib/$ARCH_TRIPLET/openblas-pthread/pkgconfig"
    export PKG_CONFIG_LIBDIR="$pcdirs" PKG_CONFIG_PATH="$pcdirs"
    export LD_LIBRARY_PATH="$prefix/gaplib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if command -v pkg-config >/dev/null; then
        PKGCONF=$(command -v pkg-config)
    elif command -v pkgconf >/dev/null; then
        PKGCONF=$(command -v pkgconf)
    else
        PKGCONF="$prefix/usr/bin/pkgconf"
        ln -sf "$prefix/usr/lib/$ARCH_TRIPLET/libpkgconf.so.3" "$prefix/gaplib/" 2>/dev/null || true
    fi
}

# ---------------------------------------------------------------- --selftest (here)

selftest() {
    local prefix build
    prefix=$(mktemp -d /tmp/ragkv-devdeps.XXXXXX)
    build="$ROOT/build-cuda-selftest"
    step "unpacking into $prefix"
    unpack "$prefix"
    make_gaplib "$prefix" all
    use_prefix "$prefix"
    PKGCONF="$prefix/usr/bin/pkgconf" # the carried one, as on a machine without any
    step "pkg-config sees the prefix only"
    for m in jansson libpcre2-8 sqlite3 openblas criterion; do
        printf '%-12s %s\n' "$m" "$("$PKGCONF" --cflags --libs "$m")"
    done
    step "configuring without CUDA, system prefixes ignored"
    rm -rf "$build"
    cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$prefix/usr" -DPKG_CONFIG_EXECUTABLE="$PKGCONF" \
        "-DCMAKE_IGNORE_PREFIX_PATH=/usr;/usr/local;/" >/dev/null
    grep -E '^(XXHASH|CIVETWEB)_(INCLUDE_DIR|LIBRARY):' "$build/CMakeCache.txt"
    if grep -E '^(XXHASH|CIVETWEB)_(INCLUDE_DIR|LIBRARY):' "$build/CMakeCache.txt" |
        grep -v "$prefix"; then
        echo "selftest: a dependency resolved outside the prefix" >&2
        exit 1
    fi
    local libs
    libs=$(grep -oE '[^ ]*lib(jansson|pcre2-8|sqlite3|openblas|criterion)\.so' "$build/build.ninja" |
           sort -u)
    echo "$libs"
    if grep -v "^$prefix" <<<"$libs"; then
        echo "selftest: a library links from outside the prefix" >&2
        exit 1
    fi
    step "building test_kernels against the prefix"
    cmake --build "$build" --target test_kernels -j "$(nproc)" >/dev/null
    step "which libraries test_kernels loads"
    ldd "$build/test_kernels" | grep -E 'jansson|pcre2|sqlite|openblas|criterion|git2|gfortran'
    # every library but the C runtime's comes from the prefix: the carried
    # set is closed under its dependencies
    local outside
    outside=$(ldd "$build/test_kernels" | awk '$2 == "=>" {print $1, $3}' |
              grep -vE '^(libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|libstdc\+\+)\.so' |
              grep -v " $prefix/" || true)
    if [ -n "$outside" ]; then
        echo "selftest: loaded from outside the prefix:" >&2
        echo "$outside" >&2
        exit 1
    fi
    step "running a few CPU kernel tests"
    "$build/test_kernels" --jobs=1 --filter 'convert/*'
    rm -rf "$prefix" "$build"
    step "selftest ok"
}

# ---------------------------------------------------------------- device run (there)

device() {
    local t_start=$SECONDS budget=${RAGKV_DEVICE_BUDGET_S:-480}
    local logs=${OUT:-$ROOT/build-cuda-device/logs}
    mkdir -p "$logs"
    local summary="$logs/summary.txt"
    : >"$summary"
    local failed=0
    record() { # name status seconds
        printf '%-34s %s (%ss)\n' "$1" "$([ "$2" -eq 0 ] && echo ok || echo "FAILED ($2)")" "$3" |
            tee -a "$summary"
        [ "$2" -eq 0 ] || failed=$((failed + 1))
    }

    local env_log="$logs/environment.txt"
    step "environment" | tee "$env_log"
    {
        uname -a
        nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv || true
        command -v nvcc && nvcc --version | tail -2
        command -v compute-sanitizer || echo "no compute-sanitizer"
        cmake --version | head -1
        ninja --version || true
        gcc --version | head -1
        nproc
    } >>"$env_log" 2>&1
    cat "$env_log"

    [ -d "$DEPS/debs" ] || {
        echo "no .devdeps/debs: run 'bash scripts/cuda-device-test.sh --fetch' where apt works and carry .devdeps" >&2
        exit 2
    }
    step "unpacking .devdeps into .devdeps/root"
    local prefix="$DEPS/root"
    unpack "$prefix"
    make_gaplib "$prefix"
    use_prefix "$prefix"
    echo "libraries taken from .devdeps (the system lacks them):" >>"$env_log"
    ls "$prefix/gaplib" >>"$env_log"
    if [ ! -e "$ROOT/../shared" ] && [ -d "$DEPS/shared" ]; then
        ln -s "$DEPS/shared" "$ROOT/../shared"
        echo "../shared -> .devdeps/shared" | tee -a "$env_log"
    fi

    local nvcc
    nvcc=$(command -v nvcc || true)
    [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
    [ -n "$nvcc" ] || { echo "no nvcc" >&2; exit 2; }
    local cc
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 |
         tr -d ' .' || true)
    [[ "$cc" =~ ^[0-9]+$ ]] || cc=90
    # A CMakeLists that passes the C warning flags to every language breaks
    # nvcc ("Unknown option '-Wall'"): then compile CUDA through a wrapper that
    # hands those flags to the host compiler instead.
    local cuda_compiler=$nvcc build="$ROOT/build-cuda-device"
    mkdir -p "$build"
    if ! grep -q 'COMPILE_LANGUAGE:C>' "$ROOT/CMakeLists.txt"; then
        cuda_compiler="$build/nvcc-wrapper"
        cat >"$cuda_compiler" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
    case "\$a" in
    -Wall|-Wextra|-Wshadow|-Wno-unused-parameter|-march=*|-fsanitize=*|-fno-omit-frame-pointer|-fno-sanitize-recover=*|-Werror)
        args+=("-Xcompiler=\$a") ;;
    -Wpedantic) ;;
    *) args+=("\$a") ;;
    esac
done
exec "$nvcc" "\${args[@]}"
EOF
        chmod +x "$cuda_compiler"
        echo "CMakeLists.txt passes C flags to nvcc: using $cuda_compiler" | tee -a "$env_log"
    fi

    local build_log="$logs/build.log" t0 rc
    step "configure and build (sm_$cc)" | tee "$build_log"
    t0=$SECONDS
    rc=0
    {
        cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRAGKV_CUDA=ON \
            -DCMAKE_CUDA_COMPILER="$cuda_compiler" -DCMAKE_CUDA_ARCHITECTURES="$cc" \
            -DCMAKE_PREFIX_PATH="$prefix/usr" -DPKG_CONFIG_EXECUTABLE="$PKGCONF" \
            ${RAGKV_DEVICE_CMAKE_ARGS:-} &&
            cmake --build "$build" -j "$(nproc)" --target test_cuda test_kernels
    } >>"$build_log" 2>&1 || rc=$?
    record "configure + build" "$rc" $((SECONDS - t0))
    if [ "$rc" -ne 0 ]; then
        tail -40 "$build_log"
        exit 1
    fi
    mkdir -p "$build/testtmp"
    ldd "$build/test_cuda" >>"$env_log" 2>&1 || true

    # name, timeout seconds, log, command... Every step is cut to what is
    # left of the run's budget (RAGKV_DEVICE_BUDGET_S, default 480 s, so one
    # call of the device tool, 600 s at most, holds the whole run).
    run_step() {
        local name=$1 limit=$2 log="$logs/$3"
        shift 3
        local left=$((budget - (SECONDS - t_start) - 15))
        if [ "$left" -lt 20 ]; then
            echo "$name: skipped, the run's time budget is spent" | tee -a "$summary"
            failed=$((failed + 1))
            return 0
        fi
        [ "$limit" -gt "$left" ] && limit=$left
        step "$name (at most ${limit}s)" | tee "$log"
        t0=$SECONDS
        rc=0
        (cd "$build" && timeout --signal=TERM --kill-after=10 "$limit" "$@") >>"$log" 2>&1 || rc=$?
        [ "$rc" -eq 124 ] && echo "(timed out after ${limit}s)" >>"$log"
        grep -E 'Synthesis|ERROR SUMMARY|RACECHECK SUMMARY|timed out' "$log" | tail -4 || true
        record "$name" "$rc" $((SECONDS - t0))
    }

    run_step "test_cuda" 300 test_cuda.log ./test_cuda --jobs=1 --verbose
    if [ -n "${RAGKV_DEVICE_QUICK:-}" ]; then
        echo "RAGKV_DEVICE_QUICK: test_kernels and the sanitizers skipped" | tee -a "$summary"
    else
        run_step "test_kernels (CPU reference)" 120 test_kernels.log ./test_kernels --jobs=4
    fi
    if [ -n "${RAGKV_DEVICE_QUICK:-}" ]; then
        :
    elif command -v compute-sanitizer >/dev/null; then
        # Criterion runs each test in a child process: follow children. The
        # light pass skips the large models and shortens the attention sweep.
        # API errors are not reported: one test provokes cudaMalloc's
        # out-of-memory on purpose, and the backend checks every API call.
        run_step "memcheck (test_cuda, light)" 240 memcheck.log \
            env RAGKV_TEST_LIGHT=1 compute-sanitizer --tool memcheck --target-processes all \
            --leak-check full --report-api-errors no --error-exitcode 99 \
            ./test_cuda --jobs=1
        run_step "racecheck (shared-memory kernels)" 180 racecheck.log \
            env RAGKV_TEST_LIGHT=1 compute-sanitizer --tool racecheck --target-processes all \
            --racecheck-report all --error-exitcode 99 \
            ./test_cuda --jobs=1 --filter 'cuda/@(attention_prefill*|rope*|rmsnorm*|kv_write*)'
    else
        echo "compute-sanitizer not found: sanitizer steps skipped" | tee -a "$summary"
        failed=$((failed + 1))
    fi
    step "summary ($((SECONDS - t_start))s)"
    cat "$summary"
    # keep every log under the device tool's 16 MiB a file
    for f in "$logs"/*.log; do
        [ "$(stat -c %s "$f")" -gt 15000000 ] && tail -c 15000000 "$f" >"$f.tmp" && mv "$f.tmp" "$f"
    done
    return "$failed"
}

case "${1:-}" in
--fetch) fetch ;;
--selftest) selftest ;;
"") device ;; # set -e: the script exits with device's failed-step count
*)
    echo "usage: bash scripts/cuda-device-test.sh [--fetch | --selftest]" >&2
    exit 2
    ;;
esac
