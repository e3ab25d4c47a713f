"""DVC stage 'bench_train' of one sweep point: python pipelines/bench_train.py POINT (posttrainllm/lab/stages/bench_train.py)."""

import sys

from posttrainllm.lab.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("bench_train", sys.argv[1:]))
