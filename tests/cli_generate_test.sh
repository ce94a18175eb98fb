#!/usr/bin/env bash
# metrale-generate end to end: the greedy tokens it prints for a fixture's prompt are the
# transformers reference's tokens, and bad arguments give a message and a non-zero exit.
set -euo pipefail
bin=worker/cli/metrale-generate
fx=tests/fixtures/tiny_a

# prompt and reference greedy tokens of case_1, read from the fixture's safetensors header
read -r prompt want < <(python3 - "$fx/case_1.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n]); d = b[8 + n:]
def ints(k):
    s, e = h[k]["data_offsets"]
    return list(struct.unpack("<%di" % ((e - s) // 4), d[s:e]))
plen = ints("prompt_len")[0]
print(",".join(map(str, ints("tokens")[:plen])), " ".join(map(str, ints("gen"))))
PY
)
out=$("$bin" --model "$fx" --prompt "$prompt" --max-new 24 2>/dev/null)
got=$(echo "$out" | sed -n 's/^generated: //p')
if [ "$got" != "$want" ]; then
  echo "FAIL: generated tokens differ from the reference"; echo " got:  $got"; echo " want: $want"; exit 1
fi
echo "ok: 24 greedy tokens equal the reference"

expect_fail() {  # expect_fail CODE PATTERN ARGS...
  local code=$1 pat=$2; shift 2
  set +e; msg=$("$bin" "$@" 2>&1); rc=$?; set -e
  if [ $rc -ne "$code" ] || ! grep -q -- "$pat" <<<"$msg"; then
    echo "FAIL: $* -> rc $rc (want $code), output: $msg"; exit 1
  fi
  echo "ok: $* -> $rc, \"$pat\""
}
expect_fail 2 "comma-separated" --model "$fx" --prompt "1,x,3"
expect_fail 2 "empty" --model "$fx" --prompt ""
expect_fail 2 "unknown option" --model "$fx" --prompt 1 --bogus 3
expect_fail 1 "outside the vocabulary" --model "$fx" --prompt "1,300"
expect_fail 1 "/no/such/dir" --model /no/such/dir --prompt 1
expect_fail 2 "cpu or cuda" --model "$fx" --prompt 1 --backend tpu
