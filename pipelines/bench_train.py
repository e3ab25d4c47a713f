"""DVC stage 'bench_train' of one sweep point: python pipelines/bench_train.py POINT (see posttrainllm/stages.py)."""

import sys

from posttrainllm.pipeline import run_stage

if __name__ == "__main__":
    sys.exit(run_stage("bench_train", sys.argv[1:]))
