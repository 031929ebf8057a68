#!/usr/bin/env bash
# add_sub throughput as frontend workers are added, on a many-core machine with no network (a lent GPU machine:
# 16 cores, Python 3.12, numpy there; nothing can be fetched). Everything else travels in .devcarry/ (git-ignored),
# made here by `bash bench/device_scaling.sh --prepare`:
#   .devcarry/whl/           tideserve's wheel and the dependencies the machine lacks (cp312 wheels)
#   .devcarry/perf_analyzer-*.whl, palibs.tar.xz   perf_analyzer and, for an older glibc, the libraries it needs
#   .devcarry/tree.tar.gz    a snapshot of HEAD with Triton's add_sub repository (../shared does not travel)
# On the machine, from the repository root: `bash bench/device_scaling.sh` (results and logs go to $OUT).
# It runs bench/addsub.py with --frontend-workers 1, 4 and 8 (--frontend-direct on, and 8 without it) over
# HTTP and gRPC, concurrency 64, 4 add_sub instances, 2 alternating rounds; SCALING_* variables change these.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY=${DEVCARRY:-$ROOT/.devcarry}
PY=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
  rm -rf "$CARRY" && mkdir -p "$CARRY/whl"
  [ -n "${DEVCARRY:-}" ] || grep -qx '/.devcarry/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.devcarry/' >> "$ROOT/.git/info/exclude"
  plat=(--python-version "${DEVICE_PYTHON_VERSION:-3.12}" --implementation cp --only-binary=:all:)
  for t in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
           manylinux_2_34 manylinux_2_35; do plat+=(--platform "${t}_x86_64"); done
  # the versions this repository's venv runs; numpy and ml_dtypes are on the machine already
  "$PY" -m pip download -q "${plat[@]}" -d "$CARRY/whl" fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 \
    httptools==0.9.0 pydantic==2.14.4 pydantic_core==2.50.5 sse-starlette==3.7.0 orjson==3.13.0 msgspec==0.22.0 \
    "tritonclient[grpc]==2.73.0" grpcio==1.85.3 grpcio-health-checking==1.81.1 protobuf==6.33.6 \
    prometheus_client==0.26.0 jinja2==3.1.6 anyio==4.16.0 h11==0.16.0 click==8.5.1 typing-extensions uvloop==0.23.0
  rm -f "$CARRY"/whl/numpy-* "$CARRY"/whl/ml_dtypes-*
  snap=$(mktemp -d)
  git -C "$ROOT" archive HEAD | tar -x -C "$snap"
  "$PY" -m pip wheel -q --no-deps -w "$CARRY/whl" "$snap"
  mkdir -p "$snap/.devshared/peers/repos" && cp -r "$ROOT/../shared/peers/repos/triton" "$snap/.devshared/peers/repos/"
  tar -czf "$CARRY/tree.tar.gz" -C "$snap" . && rm -rf "$snap"
  cp "${PEERS_HOME:-/tmp/peers}"/perf_analyzer/dl/perf_analyzer-*.whl "$CARRY/"
  libs=${PEERS_HOME:-/tmp/peers}/perf_analyzer/trixie/root/usr/lib/x86_64-linux-gnu
  tar -cJf "$CARRY/palibs.tar.xz" -h -C "$libs" ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libstdc++.so.6 \
    libgcc_s.so.1 libssl.so.3 libcrypto.so.3 libz.so.1 libzstd.so.1 libpthread.so.0 libdl.so.2 librt.so.1
  du -sh "$CARRY"
  exit 0
fi

OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site} SNAP=${SNAP:-/tmp/snap} PA=${PA:-/tmp/pa}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/whl/*.whl
export PYTHONPATH=$SITE
rm -rf "$SNAP" && mkdir -p "$SNAP" && tar -xzf "$CARRY/tree.tar.gz" -C "$SNAP"
"$PY" -m zipfile -e "$CARRY"/perf_analyzer-*.whl "$PA" && chmod +x "$PA/perf_analyzer/bin/perf_analyzer"
PEERS_BIN=${PEERS_HOME:-/tmp/peers}/bin; mkdir -p "$PEERS_BIN"
probe=$("$PA/perf_analyzer/bin/perf_analyzer" 2>&1 || true)
if grep -q -E 'error while loading|GLIBC|not found' <<<"$probe"; then
  mkdir -p "$PA/libs" && tar -xJf "$CARRY/palibs.tar.xz" -C "$PA/libs"
  printf '#!/bin/sh\nexec %s/libs/ld-linux-x86-64.so.2 --library-path %s/libs %s/perf_analyzer/bin/perf_analyzer "$@"\n' \
    "$PA" "$PA" "$PA" > "$PEERS_BIN/perf_analyzer"
else
  printf '#!/bin/sh\nexec %s/perf_analyzer/bin/perf_analyzer "$@"\n' "$PA" > "$PEERS_BIN/perf_analyzer"
fi
chmod +x "$PEERS_BIN/perf_analyzer"
{ nproc; uptime; "$PY" -c 'import sys, numpy, grpc, tideserve; print(sys.version, numpy.__version__, grpc.__version__, tideserve.__file__)'; } \
  2>&1 | tee "$OUT/machine.txt"
cd "$SNAP"
# the whole machine's busy cores every 5 s (perf_analyzer's share shows as busy beyond the server's CPU)
( prev=($(head -1 /proc/stat)); while sleep 5; do cur=($(head -1 /proc/stat)); idle=$(( cur[4] + cur[5] - prev[4] - prev[5] ))
  total=0; for i in 1 2 3 4 5 6 7 8; do total=$(( total + cur[i] - prev[i] )); done
  echo "$(date +%T) busy cores $(awk -v b=$(( total - idle )) -v t=$total -v n=$(nproc) 'BEGIN{printf "%.1f", t ? b / t * n : 0}')"
  prev=("${cur[@]}"); done ) > "$OUT/cpu.log" 2>&1 < /dev/null &
sampler=$!; trap 'kill $sampler 2>/dev/null || true' EXIT  # else it outlives the run and holds a caller's pipe open
export TIDESERVE_SHARED=$SNAP/.devshared PYTHONUNBUFFERED=1
timeout "${SCALING_TIMEOUT:-470}" "$PY" bench/addsub.py --servers ${SCALING_SERVERS:-tideserve:w1 tideserve:w4:direct tideserve:w8:direct tideserve:w8} \
  --concurrency ${SCALING_CONCURRENCY:-64} --instances "${SCALING_INSTANCES:-4}" --grpc-channel-share "${SCALING_CHANNEL_SHARE:-1}" \
  --protocols ${SCALING_PROTOCOLS:-http grpc} --rounds "${SCALING_ROUNDS:-2}" 2>&1 | tee "$OUT/scaling.log" || true
# With SCALING_TWO_CONNECTIONS_TIMEOUT (seconds), then issue 22's two-connection point: gRPC from one perf_analyzer
# whose 32 request contexts share 2 connections (16 each), one process against two direct workers.
if [ "${SCALING_TWO_CONNECTIONS_TIMEOUT:-0}" -gt 0 ]; then
  timeout "$SCALING_TWO_CONNECTIONS_TIMEOUT" "$PY" bench/addsub.py --servers tideserve:w1 tideserve:w2:direct \
    --concurrency 32 --instances "${SCALING_INSTANCES:-4}" --grpc-channel-share 16 --protocols grpc \
    --rounds "${SCALING_ROUNDS:-2}" 2>&1 | tee "$OUT/two_connections.log" || true
fi
cp bench/results/addsub-*.json "$OUT/" 2>/dev/null || true
tar -czf "$OUT/logs.tar.gz" -C /tmp $(cd /tmp && ls -d bench-addsub-* 2>/dev/null) 2>/dev/null || true
