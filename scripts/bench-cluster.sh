#!/usr/bin/env bash
# Several replicas behind HAProxy sharing Redis (docs/benchmarks.md,
# "Several replicas"): the Zipf RAG workload of `ragkv bench` (its HTTP
# runner, --modes rag) through deploy/haproxy/haproxy.cfg, three ways:
#
#   single     one replica, no Redis, no HAProxy      (the baseline)
#   affinity   N replicas + Redis + HAProxy as shipped (hash on the first document)
#   roundrobin N replicas + Redis + HAProxy with `balance roundrobin`
#
# Each run starts from fresh processes (empty KV memory, empty Redis). It
# prints the bench's TTFT p50/p99 and request rate, the chunks computed
# cluster-wide (sum of ragkv_chunk_misses_total) against those of the single
# replica (every distinct chunk, computed once), and each replica's hits by
# tier (arena, redis, prefix).
#
# With --faults, three more runs of the affinity setup, 12 times as many
# requests generating 4 tokens each, with a fault injected 2 s in, and the
# requests that failed (a restarted replica's counters start again at 0):
#   kill9    one replica killed with SIGKILL mid-run (not restarted)
#   sigterm  one replica stopped with SIGTERM mid-run, not drained in HAProxy
#            first (not restarted)
#   rolling  every replica in turn: drained in HAProxy (runtime API), stopped
#            with SIGTERM, restarted, put back once /ready
#   redis    redis-server killed mid-run and started again empty
#
#   [KV_MB=8] [K=4] scripts/bench-cluster.sh [--faults] MODEL [BIN] [REPLICAS] [REQUESTS]
# Needs curl, haproxy, redis-server and python3.
# Loopback only; everything it starts is stopped at the end.
set -euo pipefail
faults=0
[ "${1:-}" = --faults ] && { faults=1; shift; }
model=${1:?usage: scripts/bench-cluster.sh [--faults] MODEL [BIN] [REPLICAS] [REQUESTS]}
bin=${2:-build/ragkv}
n=${3:-3}
requests=${4:-300}
# KV memory per replica (MiB): small enough that one replica's chunk pool
# does not hold the whole corpus, which is where affinity matters. K: chunks
# per request (the hash sees the first).
kv_mb=${KV_MB:-8}
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/bench-lib.sh
. "$here/scripts/bench-lib.sh"
for tool in curl haproxy redis-server python3; do
    command -v $tool >/dev/null || { echo "bench-cluster: $tool is required" >&2; exit 2; }
done
# The workload: small enough for stories260K's context, Zipf-popular chunks.
workload=(--modes rag --requests "$requests" --corpus 120 --k "${K:-4}" --chunk-tokens 24:48
    --question-tokens 8 --system-tokens 16 --zipf 1.1 --concurrency 6 --seed 7)
base=$((20000 + RANDOM % 20000))
work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# start_replica I REDIS_PORT: replica I on port base+I ($rep_pid[I]).
declare -A rep_pid
start_replica() {
    local i=$1 rport=$2 extra=()
    [ "$rport" != 0 ] && extra=(--redis "redis://127.0.0.1:$rport" --redis-min-tokens 1
        --redis-secret-file "$work/secret")
    bench_serve "$bin" "$model" $((base + i)) "$work/replica$i.log" --kv-memory-mb "$kv_mb" \
        --host 127.0.0.1 --grace-s 10 "${extra[@]}"
    rep_pid[$i]=$BENCH_SERVER
    pids+=("$BENCH_SERVER")
}

start_redis() {
    redis-server --port $((base + 90)) --bind 127.0.0.1 --save "" --appendonly no \
        --maxmemory 512mb --maxmemory-policy allkeys-lru --dir "$work" --daemonize no \
        >"$work/redis.log" 2>&1 &
    redis_pid=$!
    pids+=("$redis_pid")
    for _ in $(seq 100); do
        redis-cli -p $((base + 90)) ping >/dev/null 2>&1 && return 0
        sleep 0.05
    done
    echo "redis-server did not start" >&2
    exit 1
}

# start_haproxy BALANCE: the shipped config, ports and socket rewritten.
start_haproxy() {
    local servers=""
    for i in $(seq 1 "$n"); do servers+="    server ragkv-$i 127.0.0.1:$((base + i))\n"; done
    sed -e "s|^    bind :8080|    bind 127.0.0.1:$((base + 80))|" \
        -e "s|^    server-template ragkv-.*|$servers|" \
        -e "s|/run/haproxy/ragkv-admin.sock|$work/admin.sock|" \
        -e "s|^    log stdout.*|    log stderr format raw local0 warning|" \
        "$here/deploy/haproxy/haproxy.cfg" >"$work/haproxy.cfg"
    [ "$1" = roundrobin ] && sed -i 's|^    balance hash .*|    balance roundrobin|' "$work/haproxy.cfg"
    haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
    lb_pid=$!
    pids+=("$lb_pid")
    for _ in $(seq 100); do
        curl -sf "http://127.0.0.1:$((base + 80))/ready" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "haproxy did not start: $(cat "$work/haproxy.log")" >&2
    exit 1
}

stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do { wait "$p"; } 2>/dev/null || true; done
    pids=()
}

# report NAME: the bench's figures and each live replica's counters.
report() {
    python3 - "$1" "$work/bench.json" "$n" "$base" "$work" <<'EOF'
import json, sys, urllib.request
name, path, n, base, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
b = json.load(open(path))
rag = b["modes"]["rag"]
def metrics(port):
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except Exception:
        return None
    v = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        k, x = line.rsplit(" ", 1)
        v[k] = float(x)
    return v
rows, misses = [], 0
for i in range(0 if name == "single" else 1, (1 if name == "single" else n + 1)):
    m = metrics(base + i)
    if m is None:
        rows.append(f"    replica {i}: gone")
        continue
    h = {s: int(m.get(f'ragkv_chunk_hits_total{{source="{s}"}}', 0)) for s in ("arena", "redis", "prefix")}
    miss = int(m.get("ragkv_chunk_misses_total", 0))
    misses += miss
    ok = int(m.get('ragkv_requests_total{status="200"}', 0))
    rows.append(f"    replica {i}: computed {miss:5d}  hits arena {h['arena']:5d}  redis {h['redis']:5d}"
                f"  prefix {h['prefix']:5d}  requests {ok}")
t = rag["ttft_ms"]
print(f"{name:10s} requests {rag['requests']} ok {rag['ok']} failed {rag['requests'] - rag['ok']}  "
      f"TTFT p50 {t['p50']:.1f} ms p99 {t['p99']:.1f} ms  {rag['requests_per_s']:.1f} req/s  "
      f"chunks computed cluster-wide {misses}")
print("\n".join(rows))
open(f"{work}/computed-{name}", "w").write(str(misses))
EOF
}

# run_bench PORT [ARGS...]: the workload (ARGS after it win) through PORT.
run_bench() {
    local port=$1
    shift
    "$bin" bench --model "$model" --url "http://127.0.0.1:$port" "${workload[@]}" "$@" --json \
        >"$work/bench.json" 2>"$work/bench.err" && return 0
    # Under a fault failed requests are the measurement: the bench still
    # wrote its JSON.
    [ "${tolerate_failures:-0}" = 1 ] && [ -s "$work/bench.json" ] && return 0
    cat "$work/bench.err" >&2
    exit 1
}

head -c 32 /dev/urandom | base64 >"$work/secret"
echo "model $model, $n replicas, --kv-memory-mb $kv_mb, ${workload[*]}"
# The distinct chunks of the request list: what an in-process run, one
# request at a time with room for every chunk, computes.
"$bin" bench --model "$model" "${workload[@]}" --concurrency 1 --kv-memory-mb 1024 --json \
    2>/dev/null | python3 -c 'import json, sys
print("distinct chunks in the workload:", json.load(sys.stdin)["modes"]["rag"]["chunks"]["misses"])'

start_replica 0 0
run_bench $((base + 0))
report single
stop_all

for balance in affinity roundrobin; do
    start_redis
    for i in $(seq 1 "$n"); do start_replica "$i" $((base + 90)); done
    start_haproxy $balance
    run_bench $((base + 80))
    report $balance
    stop_all
done

[ $faults = 1 ] || exit 0
tolerate_failures=1
# A command to HAProxy's runtime API (what `socat stdio unix-connect:SOCK` does).
admin() {
    python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(sys.argv[2].encode() + b"\n")
s.recv(4096)' "$work/admin.sock" "$1"
}
for fault in kill9 sigterm rolling redis; do
    start_redis
    for i in $(seq 1 "$n"); do start_replica "$i" $((base + 90)); done
    start_haproxy affinity
    # Long enough (about 15 s here) for the fault to land mid-run, with
    # streams of 4 tokens in flight.
    run_bench $((base + 80)) --requests $((requests * 12)) --max-tokens 4 &
    bench_pid=$!
    sleep 2
    case $fault in
    kill9)
        kill -9 "${rep_pid[2]}"
        { wait "${rep_pid[2]}"; } 2>/dev/null || true # no "Killed" line
        ;;
    sigterm) kill "${rep_pid[2]}" ;;
    rolling)
        for i in $(seq 1 "$n"); do
            admin "set server ragkv/ragkv-$i state drain"
            sleep 1 # requests it has now finish; none new arrive
            kill "${rep_pid[$i]}"
            wait "${rep_pid[$i]}" 2>/dev/null || true
            start_replica "$i" $((base + 90))
            admin "set server ragkv/ragkv-$i state ready"
            sleep 2 # back up in the checks (rise 2)
        done
        ;;
    redis)
        kill -9 "$redis_pid"
        { wait "$redis_pid"; } 2>/dev/null || true
        sleep 2
        start_redis
        ;;
    esac
    wait $bench_pid
    report "$fault"
    stop_all
done
