#!/usr/bin/env bash
# Compares the checker with SPIN on naive dining philosophers (docs/spec.md,
# "Parallel, bitstate and swarm"): the same model in Promela and in Go
# (spec/checker/philosophers), every state explored (pan -E: the deadlock is
# not a stop), one run after the other in this script, and prints a Markdown
# table: states, transitions, wall and CPU seconds, states per wall and per CPU
# second, peak RSS and bytes per state. Needs Debian's spin package and gcc:
#   apt-get install spin
# Usage: scripts/spin-compare.sh [N ...]   (default 16; 18 takes minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v spin >/dev/null || { echo "spin not found: apt-get install spin" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
go build -o "$dir/philocheck" ./scripts/philocheck
cat > "$dir/philo.pml" <<'PML'
bit fork[N];
active [N] proctype phil() {
	byte l = _pid;
	byte r = (_pid + 1) % N;
think:	atomic { fork[l] == 0 -> fork[l] = 1 };
	atomic { fork[r] == 0 -> fork[r] = 1 };
	atomic { fork[l] = 0; fork[r] = 0 };
	goto think
}
PML

# measure NAME STATES_FROM CMD...: runs CMD under /usr/bin/time and prints a row.
row() { # name states transitions wall cpu rss_kb
	awk -v n="$1" -v s="$2" -v t="$3" -v w="$4" -v c="$5" -v r="$6" 'BEGIN {
		printf "| %s | %d | %d | %.2f | %.2f | %.0f | %.0f | %.0f | %.1f |\n", n, s, t, w, c, s / w, s / c, r / 1024, r * 1024 / s }'
}

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores, $(date -u +%FT%TZ)"
echo
echo "| N, tool and mode | states | transitions | wall s | CPU s | states/s | states per CPU s | peak RSS MiB | bytes/state (RSS) |"
echo "|---|---|---|---|---|---|---|---|---|"
for n in "${@:-16}"; do
	(cd "$dir" && spin -a -DN="$n" philo.pml >/dev/null)
	# A hash table of 2^w slots, at least one per state, and a DFS stack twice
	# as deep as there are states (at 16, a stack of 2.4^16 frames cut the
	# search: 1,331,702 states of 1,331,714): both sized from 2.4^n, about the
	# number of states. A row whose states differ from the checker's was cut.
	w=$(awk -v n="$n" 'BEGIN { s = 1; w = 0; while (s < 2.4 ^ n) { s *= 2; w++ } print w }')
	m=$(awk -v n="$n" 'BEGIN { printf "%d", 2 * 2.4 ^ n }')
	for mode in exhaustive bitstate; do
		flags=(-O2 -DNOREDUCE -DSAFETY -DMEMLIM=65536)
		run=(-E -m"$m" -w"$w")
		if [ "$mode" = bitstate ]; then
			flags+=(-DBITSTATE)
			run=(-E -m"$m" -w30) # 2^30 bits: 128 MiB
		fi
		gcc "${flags[@]}" -o "$dir/pan" "$dir/pan.c"
		/usr/bin/time -f "%e %U %S %M" -o "$dir/time" "$dir/pan" "${run[@]}" > "$dir/out" 2>&1
		read -r wall user sys rss < "$dir/time"
		states=$(awk '/states, stored/ { print $1 }' "$dir/out")
		trans=$(awk '/transitions \(= stored\+matched\)/ { print $1 }' "$dir/out")
		row "$n, SPIN $(spin -V | awk '{print $3}') pan, $mode" "$states" "$trans" "$wall" "$(echo "$user + $sys" | bc)" "$rss"
	done
	for run in "exhaustive, 1 worker:-workers 1" "exhaustive, 2 workers:-workers 2" "bitstate 128 MiB, 2 workers:-workers 2 -bitstate 134217728"; do
		/usr/bin/time -f "%e %U %S %M" -o "$dir/time" "$dir/philocheck" -n "$n" ${run#*:} > "$dir/out"
		read -r wall user sys rss < "$dir/time"
		read -r _ states _ trans _ < "$dir/out"
		row "$n, kvhandoff checker, ${run%%:*}" "$states" "$trans" "$wall" "$(echo "$user + $sys" | bc)" "$rss"
	done
done
