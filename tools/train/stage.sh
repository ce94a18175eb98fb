#!/bin/bash
# Lays out what the device needs under DEST (default: the main checkout's ignored .gpu/train):
# the scripts, the token streams and the tokenizer files. Run from the repository root after
# make_corpus.py, make_tokenizer.py and encode_corpus.py (CORPUS and TOKENS are their output dirs).
set -e
CORPUS=${CORPUS:-/tmp/corpus}; TOKENS=${TOKENS:-/tmp/tokens}; DEST=${1:-/work/main/.gpu/train}
mkdir -p $DEST/tools $DEST/data $DEST/tok
cp tools/train/*.py tools/train/device_run.sh $DEST/tools/
cp $TOKENS/train.u16 $TOKENS/heldout.u16 $DEST/data/
cp models/glm5-next-demo/tokenizer.json models/glm5-next-demo/tokenizer_config.json \
   models/glm5-next-demo/generation_config.json $DEST/tok/
cp $CORPUS/heldout.txt $DEST/tok/
du -sh $DEST
