#!/usr/bin/env bash
# Runs a bitstate swarm of kvhandoff check as N processes on this machine and
# merges their reports (docs/spec.md, "Parallel, bitstate and swarm"; the same
# on a cluster: docs/swarm-job.yaml).
# Usage: scripts/swarm.sh N [kvhandoff check flags...]
#   e.g. scripts/swarm.sh 4 --requests 3 --bitstate-size 4MiB --max-memory 1GiB
# Each member gets --workers 1 (N processes share the cores). Exit status: check merge's.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/swarm.sh N [check flags...]}
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
go build -o "$dir/kvhandoff" ./cmd/kvhandoff
pids=()
for ((i = 0; i < n; i++)); do
	"$dir/kvhandoff" check --bitstate --swarm-count "$n" --swarm-index "$i" --workers 1 --json --quiet "$@" > "$dir/member-$i.json" &
	pids+=($!)
done
for i in "${!pids[@]}"; do
	code=0
	wait "${pids[$i]}" || code=$?
	if [ "$code" -gt 1 ]; then
		echo "swarm: member $i exited $code" >&2
	fi
done
"$dir/kvhandoff" check merge "$dir"/member-*.json
