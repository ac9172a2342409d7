#!/bin/bash
# Exploratory GPU run: everything lands in /tmp/r, tarred into $OUT at the end.
export PYTHONPATH=src GPULAB_DATA=.gpu/data PYTHONUNBUFFERED=1
R=/tmp/r; mkdir -p $R; T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
step() { local name=$1 limit=$2; shift 2; local l=$(left); [ $l -lt $limit ] && limit=$l
  [ $limit -le 5 ] && { echo "SKIP $name (no time)"; return; }
  local s=$(date +%s); timeout -k 5 $limit "$@" > $R/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s"; }
{ nvidia-smi; nproc; python3 -c "import torch,sys;print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.is_available())"; python3 -m pip list 2>/dev/null | grep -iE "torch|onnx|nvidia-ml|rich|psutil|matplotlib|pytest"; } > $R/env.txt 2>&1
step facts 60 python3 .gpu/facts.py
step devices 30 python3 -m gpulab devices
step devices-json 30 python3 -m gpulab devices --json
step devices-hidden 30 env CUDA_VISIBLE_DEVICES= python3 -m gpulab devices
step devices-bad 30 env CUDA_VISIBLE_DEVICES=3 python3 -m gpulab devices
for s in item_every_step pageable_copy pinned_blocking_copy annotated_step tiny_kernels masked_index; do
  step prof-$s 60 python3 -m gpulab profile --out $R/prof-$s -- python3 tests/monitor/scripts/$s.py
done
step prof-children 60 python3 -m gpulab profile --out $R/prof-children -- python3 tests/monitor/scripts/trainers_in_children.py spawn
step train 90 python3 -m gpulab train --devices cuda --epochs 2 --out $R/train-lenet
step parity 60 python3 -m gpulab train --devices cuda --check-parity
step launch1 90 python3 -m gpulab launch -n 1 -- --epochs 1 --out $R/launch1
step bench 120 python3 -m gpulab bench --preset quick --out $R/bench matmul transfer sync-logging
step pytest 400 python3 -m pytest -q -rs -p no:cacheprovider -x --timeout 120 tests/monitor/test_gpu.py tests/test_devices.py tests/bench tests/parallel/test_allreduce.py tests/test_cli.py
step pytest-all 400 python3 -m pytest -q -rs -p no:cacheprovider --timeout 120 tests
cp $R/facts.log $OUT/facts.json 2>/dev/null
tar czf $OUT/r1.tgz -C /tmp r
echo total $(( $(date +%s) - T0 ))s
