# The proof that the VM's trace check fails (run.sh --inject-sweep), on decode-0's real
# trace: after the first verification of a request of at most 8 pages (the spec's bound,
# so it is replayed; pt is the pages' tokens), the decode node's own sweep of the
# verified pages, the event the bug no-cut-call-cancel leaves (docs/trace.md), its later
# events numbered on. Numbers are copied as text: request ids and clocks pass 2^53.
#   awk -v pt=16 -f inject-sweep.awk serve.decode-0 > injected
function num(line, key) {
  if (match(line, "\"" key "\":[0-9]+")) return substr(line, RSTART + length(key) + 3, RLENGTH - length(key) - 3)
  return ""
}
/"ev":"recv"/ && /"msg":"Bootstrap"/ && num($0, "tokens") + 0 <= 8 * pt { small[num($0, "req")] = 1 }
done { sub(/"seq":[0-9]+/, "\"seq\":" (num($0, "seq") + 1)) }
{ print }
!done && /"ev":"verified"/ && (num($0, "req") in small) {
  printf "{\"node\":\"decode-0\",\"seq\":%d,\"t\":%s,\"ev\":\"cancel\",\"req\":%s,\"cause\":\"sweep-no-call\"}\n", num($0, "seq") + 1, num($0, "t"), num($0, "req")
  done = 1
}
END { if (!done) { print "inject: no verified request of at most 8 pages on decode-0" > "/dev/stderr"; exit 1 } }
