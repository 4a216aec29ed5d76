#!/usr/bin/env bash
# Regenerates the blocks of docs/ that are the model checker's output, between
#   <!-- gen:NAME -->  and  <!-- /gen:NAME -->
# markers. CI runs it and fails if docs/ changed: the docs show what the code does.
# Timing lines (which differ run to run) are left out.
set -euo pipefail
cd "$(dirname "$0")/.."
# KVH_BIN: a kvhandoff binary built from this commit (CI passes the one it built).
bin=${KVH_BIN:-}
if [ -z "$bin" ]; then
  bin=$(mktemp -d)/kvhandoff
  go build -o "$bin" ./cmd/kvhandoff
fi

# output CMD...: run kvhandoff, keep its stdout whatever the exit status, drop timing lines.
output() {
  { "$bin" "$@" --quiet || true; } | grep -v -E '^(%% )?(violation of .* in [0-9]+ steps \(|[0-9]+ explorations in )' | trim
}

# trim drops trailing blank lines.
trim() { awk 'NF { for (; n > 0; n--) print ""; print; next } { n++ }'; }

# fill FILE NAME: replace the block NAME in FILE with stdin.
fill() {
  local file=$1 name=$2 body
  body=$(mktemp)
  cat >"$body"
  awk -v name="$name" -v body="$body" '
    $0 == "<!-- gen:" name " -->" { print; while ((getline line < body) > 0) print line; skip = 1; next }
    $0 == "<!-- /gen:" name " -->" { skip = 0 }
    !skip { print }
  ' "$file" >"$file.tmp"
  mv "$file.tmp" "$file"
  grep -q -- "<!-- /gen:$name -->" "$file" || { echo "gendocs: $file lacks the block $name" >&2; exit 1; }
}

incident="admit-finished,no-token-check,no-tag-check"
{ echo '```'; output check --bug "$incident"; echo '```'; } | fill docs/incident.md incident-trace
{ echo '```mermaid'; output check --bug "$incident" --trace-format mermaid | sed -n '/^sequenceDiagram/,$p'; echo '```'; } | fill docs/incident.md incident-mermaid
# KVH_MATRIX: a file holding the output of `kvhandoff check --matrix` from this commit
# (CI passes the one it just computed; the matrix takes about 5 minutes of 2 cores).
if [ -n "${KVH_MATRIX:-}" ]; then
  { echo '```'; grep -v -E '^[0-9]+ explorations in ' "$KVH_MATRIX" | trim; echo '```'; } | fill docs/spec.md matrix
else
  { echo '```'; output check --matrix; echo '```'; } | fill docs/spec.md matrix
fi
# KVH_MUTANTS: a file holding the output of `kvhandoff check --mutants scripts/check-configs`
# from this commit (CI passes the one its mutation gate just printed).
if [ -n "${KVH_MUTANTS:-}" ]; then
  { echo '```'; grep -v -E '^[0-9]+ explorations in ' "$KVH_MUTANTS" | trim; echo '```'; } | fill docs/spec.md mutants
else
  { echo '```'; output check --mutants scripts/check-configs; echo '```'; } | fill docs/spec.md mutants
fi
for sw in admit-finished eager-release timeout-free no-checksum leak-on-cancel no-peer-cancel double-free checksum-hangs pool-wide-key verify-before-revoke unticketed-bootstrap scope-dropped client-scope evict-pinned prefix-count-mismatch write-shared write-uncomputed free-computing; do
  { echo '```'; output check --bug "$sw" | grep -E '^(VIOLATION|  *[0-9]+\. )'; echo '```'; } | fill docs/spec.md "trace-$sw"
done
{ echo '```'; output check --bug peer-by-name --restarts 1 | grep -E '^(VIOLATION|  *[0-9]+\. )'; echo '```'; } | fill docs/spec.md trace-peer-by-name
for combo in abort-still-sends,no-tag-check prefill-early-free,no-checksum done-unmatched,no-tag-check abort-frees-source,no-checksum; do
  { echo '```'; output check --bug "$combo" --need-all | grep -E '^(VIOLATION|  *[0-9]+\. )'; echo '```'; } | fill docs/spec.md "trace-$combo"
done
