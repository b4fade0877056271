#!/usr/bin/env bash
# The device call copies the working tree (tracked files + carried paths) up to 64 MiB; this folder's result
# archives grow with every session. Before a call: `bash benchmarks/device/travel_light.sh out` moves the oldest
# session folders of benchmarks/results/ (s<N>/) to $HOLD (default /tmp/triaccel-hold) until the tracked files
# and .device/ take at most $LIMIT_MIB (default 60); after the call: `... back` puts them back and checks that
# git sees no deletion. Never commit while they are out.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
HOLD=${HOLD:-/tmp/triaccel-hold}; LIMIT_MIB=${LIMIT_MIB:-60}
size_kib() { { git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1; du -sk .device 2>/dev/null | cut -f1 || echo 0; } | paste -sd+ | bc; }
case "${1:-}" in
  out)
    mkdir -p "$HOLD"
    for d in $(ls -d benchmarks/results/s[0-9]* 2>/dev/null | sort -V); do
      [ "$(size_kib)" -le $((LIMIT_MIB * 1024)) ] && break
      mv "$d" "$HOLD/"; echo "moved $d"
    done
    echo "travelling: $(( $(size_kib) / 1024 )) MiB (limit ${LIMIT_MIB})" ;;
  back)
    for d in "$HOLD"/s[0-9]*; do [ -e "$d" ] && mv "$d" benchmarks/results/ && echo "back $(basename "$d")"; done
    if git status --short -- benchmarks/results | grep -q '^ D'; then
      echo "deletions remain under benchmarks/results: git checkout -- benchmarks/results" >&2; exit 1
    fi ;;
  *) echo "usage: $0 out|back" >&2; exit 2 ;;
esac
