#!/bin/bash
# Decode-step time (prefixkv and transformers, batch 16, 200 shared tokens) with and without a
# competing 2-thread matmul process, for 2 threads, 2 threads + OMP_WAIT_POLICY=PASSIVE, 1 thread.
cd "$(dirname "$0")/.." && source .venv/bin/activate
OUT=bench/results/contention; mkdir -p $OUT
for noise in quiet noise; do
  if [ $noise = noise ]; then
    python -c "
import torch; torch.set_num_threads(2); a=torch.randn(512,576); b=torch.randn(576,1536)
while True: a@b" & NP=$!
    sleep 3
  fi
  for cfg in "t2" "t2-passive" "t1"; do
    case $cfg in
      t2) ENVS=""; TH=2;;
      t2-passive) ENVS="OMP_WAIT_POLICY=PASSIVE"; TH=2;;
      t1) ENVS=""; TH=1;;
    esac
    echo "=== $noise $cfg"
    env $ENVS timeout 400 python -m bench.profile_decode --batch 16 --system-tokens 200 --steps 10 --threads $TH --json $OUT/$noise-$cfg.json 2>&1 | grep -E "whole step|model.forward|attention \(|transformers decode"
  done
  if [ $noise = noise ]; then kill $NP; fi
done
