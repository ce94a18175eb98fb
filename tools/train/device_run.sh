#!/bin/bash
# Runs on the device from a folder laid out by tools/train/stage.sh:
#   tools/ (these scripts), data/ (train.u16, heldout.u16), tok/ (tokenizer files, heldout.txt)
#   bash tools/device_run.sh SECONDS BATCH CHECK_SEQS [EXTRA]
# Trains for SECONDS, saves the checkpoint, runs check.py and eval_ppl.py on it, and puts
# model.safetensors and result.tar (everything else) under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
S=$1; B=$2; N=$3; EXTRA=$4
W=/tmp/work; M=$W/glm5-next-demo; L=$W/log
mkdir -p $M $L
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee $L/gpu.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a $L/gpu.txt
if [ "$EXTRA" = "src" ]; then
  python3 - <<'PY'
import os, shutil, transformers
from transformers.models.glm5_next import modeling_glm5_next as m, configuration_glm5_next as c
d = os.environ["OUT"]
shutil.copy(m.__file__, d); shutil.copy(c.__file__, d)
print([n for n in dir(transformers) if n.startswith("Glm5Next")])
PY
fi
python3 tools/train.py --data data --out $M --logdir $L --seconds $S --batch $B 2>&1 | tee $L/train.out || echo TRAIN_FAILED
cp tok/* $M/
python3 tools/check.py --model $M --data data --out $L/check_report.json --seqs $N 2>&1 | tee $L/check.out || echo CHECK_FAILED
python3 tools/eval_ppl.py --model $M --data data --out $M/heldout_ppl.json 2>&1 | tee $L/eval.out || echo EVAL_FAILED
cp $M/model.safetensors $OUT/ 2>/dev/null
tar -C $W --exclude=model.safetensors -cf $OUT/result.tar glm5-next-demo log
ls -la $OUT $M
