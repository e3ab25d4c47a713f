"""The stages of one point, in order: reference -> kernel -> parity -> microbench -> bench_train -> receipt.

One module per DVC stage, named as in dvc.yaml (reference.py, kernel.py, parity.py, microbench.py,
bench_train.py, receipt.py), each with its `run_<stage>`; what several share is in common.py. This
package imports none of them: a stage process loads its own module and common.py only, so an edit to
one stage's module reruns that stage alone (lab/reads.py STAGES).

Each stage reads the config and the files earlier stages wrote in the point's
folder, and writes its own files there. None talks to MLflow but the receipt.
DVC runs them one process per stage (pipelines/*.py); `posttrainllm bench` runs
the same functions in one process. Every stage is generic over the op: what is
op-specific comes from its package in posttrainllm/ops/<op>/.

A path that breaks its contract is a result, not a crash: parity records the
verdict and the first failing case, and from then on the path gets no speed,
throughput, roofline, curve or training time anywhere. The stage still writes
its report and raises `ContractBroken` so an interactive command can exit 1;
the DVC entry point records it and lets the sweep run on.

A path that raises is located (track/failures.py: the innermost frame of its own code, its traceback in
tracebacks/<path>.txt); one whose failure says this machine lacks what it needs (a GPU driver, CUDA, a gap of
Triton's interpreter) gets the verdict "cannot run here": no speed either, and never a broken contract. The
parity stage's headline counts the paths that broke the contract and names those apart."""
