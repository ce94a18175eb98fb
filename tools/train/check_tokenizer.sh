#!/bin/bash
# Checks that the repo's C tokenizer (bazel-bin/tools/metrale-tokenize) gives the ids of the
# Python `tokenizers` library for the demo model's tokenizer.json, on a few strings (real newlines,
# tabs, CRLF, Unicode, added tokens) and on the whole held-out text, with and without the
# [gMASK]<sop> prefix. Run from the repository root after `bazel build //tools:metrale-tokenize`.
set -euo pipefail
M=${1:-models/glm5-next-demo}
T=bazel-bin/tools/metrale-tokenize
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp" <<'PY'
import sys
d = sys.argv[1]
cases = [
    "Hello, world! It's 2024 and we'll see.",
    "def f(x):\n    return x**2  # square\n\n\nprint(f(3))\n",
    "<|user|>\nHi there<think>ok</think> naïve café 日本語 🙂\n<|assistant|>\n",
    "   spaces\t\ttabs\r\n\r\nend   ",
    "[gMASK]<sop>already prefixed<|endoftext|>",
]
for i, c in enumerate(cases):
    open(f"{d}/case{i}.txt", "w", encoding="utf-8", newline="").write(c)
PY
cp "$M/heldout.txt" "$tmp/case_heldout.txt"
fail=0
for f in "$tmp"/case*.txt; do
  for flag in "" "--no-special"; do
    c=$($T --model "$M" --file "$f" $flag)
    p=$(python3 -c "
import sys
from tokenizers import Tokenizer
t = Tokenizer.from_file('$M/tokenizer.json')
s = open('$f', encoding='utf-8', newline='').read()
print(','.join(map(str, t.encode(s, add_special_tokens=('$flag' == '')).ids)))")
    n=$(echo "$p" | tr ',' '\n' | wc -l)
    if [ "$c" = "$p" ]; then echo "same  $(basename "$f") $flag ($n ids)"; else echo "DIFF  $(basename "$f") $flag"; fail=1; fi
  done
done
exit $fail
