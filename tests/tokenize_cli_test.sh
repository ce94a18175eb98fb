#!/usr/bin/env bash
# metrale-tokenize on the GLM-style fixture: text -> ids -> the same text (less the special tokens
# when they are skipped), the [gMASK]<sop> prefix, the eos ids, and a clear error for a
# directory without tokenizer.json.
set -euo pipefail
T=tools/metrale-tokenize
M=tests/fixtures/glm_tok
text=$'Hello, wörld! <|user|> 中文 😀\n  x = 42'
ids=$("$T" --model "$M" --text "$text")
case "$ids" in 6002,6004,*) ;; *) echo "FAIL: no [gMASK]<sop> prefix: $ids"; exit 1 ;; esac
back=$("$T" --model "$M" --ids "$ids" --skip-special)
[[ "$back" == "${text/<|user|>/}" ]] || { echo "FAIL: decode skipping specials gave '$back'"; exit 1; }
with=$("$T" --model "$M" --ids "$ids")
[[ "$with" == "[gMASK]<sop>$text" ]] || { echo "FAIL: decode with specials gave '$with'"; exit 1; }
"$T" --model "$M" --info | grep -qx 'eos 6000 6007' || { echo "FAIL: eos ids"; exit 1; }
if "$T" --model tests/fixtures/tiny_a --text x 2>err.txt; then echo "FAIL: loaded no tokenizer"; exit 1; fi
grep -q 'tokenizer.json' err.txt || { echo "FAIL: error does not name the file"; cat err.txt; exit 1; }
echo "tokenize_cli_test: ok"
