#!/usr/bin/env bash
# Check in a headless browser that the MLflow UI shows this project's runs, not MLflow 3's
# GenAI "Traces" overview. Needs chromium (Debian: apt-get install -y chromium) and MLflow.
#
#   scripts/check-mlflow-ui.sh            # exit 0: runs table shown; 1: it is not; 2: cannot check here
#
# It logs a small sweep (two points) and one lone point into a fresh sqlite store in a temp
# folder through posttrainllm.track.receipt, starts `mlflow ui` on 127.0.0.1 (one worker, no
# job execution), and dumps the rendered page of
#   http://127.0.0.1:PORT/#/experiments/ID?workflowType=machine_learning
# It checks: the experiment carries mlflow.experimentKind=custom_model_development, the page
# lists the runs (the sweep's run and the lone point), and the GenAI overview is absent; and the
# address `posttrainllm ui` prints opens the experiment's saved view (its columns, points grouped by sweep).
# It also reports (without failing) where the bare experiment URL lands: MLflow 3.17's UI
# picks the page from its "GenAI / Model training" switch (the URL's workflowType, else the
# browser's saved choice, GenAI by default), not from the experiment's tag.
# PYTHON (default: python3) is the interpreter with posttrainllm and mlflow installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$CHROMIUM" ]; then
  echo "check-mlflow-ui: no chromium here (apt-get install -y chromium); not checked" >&2
  exit 2
fi
work=$(mktemp -d)
server=
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
uri="sqlite:///$work/mlflow.db"

read -r experiment port < <(PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$uri" "$work" <<'EOF'
import socket, sys, uuid
from pathlib import Path
from posttrainllm.track import receipt

uri, work = sys.argv[1], Path(sys.argv[2])
def small(point, sweep=None):
    return {"schema": receipt.SCHEMA, "point": point, "sweep": sweep, "created_at": "2026-01-01T00:00:00+00:00",
            "provenance": {"revision": "0" * 40, "dirty": False, "triton_interpreted": True,
                           "machine": {"device": "cpu", "device_name": "cpu", "threads": 1, "torch": "-",
                                       "triton": "-", "python": "-"}},
            "config": {"tile": {"block_q": 64}}, "kernel": None, "microbench": None, "bench_train": None,
            "parity": {"verdict": "pass", "precision": "fp32", "contract": {}, "rule": "", "notes": [],
                       "paths": {}}}
sweep = {"name": "ui-check", "id": uuid.uuid4().hex[:16], "changes": {}, "points": ["ui-point-a", "ui-point-b"]}
for point in sweep["points"]:
    receipt.log_to_mlflow(small(point, sweep), work, uri)
receipt.log_to_mlflow(small("ui-lone-point"), work, uri)
from mlflow.tracking import MlflowClient
experiment = MlflowClient(uri).get_experiment_by_name(receipt.EXPERIMENT)
assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development", experiment.tags
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    print(experiment.experiment_id, s.getsockname()[1])
EOF
)
echo "check-mlflow-ui: experiment $experiment tagged mlflow.experimentKind=custom_model_development"

MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$PYTHON" -m mlflow ui --backend-store-uri "$uri" \
  --host 127.0.0.1 --port "$port" --workers 1 >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 90); do
  if "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
       "http://127.0.0.1:$port/health" 2>/dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then cat "$work/server.log" >&2; echo "check-mlflow-ui: server died" >&2; exit 2; fi
  sleep 1
done

page() {  # the page's visible text, after its scripts ran
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
    --disable-sync --no-first-run --user-data-dir="$work/profile-$RANDOM" --virtual-time-budget=15000 --window-size=1920,1080 \
    --dump-dom "$1" 2>/dev/null | "$PYTHON" -c '
import re, sys
html = sys.stdin.read()
text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", html, flags=re.S)
print(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))'
}
genai_overview='Tokens per Trace|Token Usage|No data available for the selected time range'
base="http://127.0.0.1:$port/#/experiments/$experiment"

linked=$(page "$base?workflowType=machine_learning")
status=0
for want in "sweep ui-check" "ui-lone-point" "matching runs"; do
  if ! grep -q "$want" <<<"$linked"; then echo "check-mlflow-ui: FAIL: '$want' not on $base?workflowType=machine_learning" >&2; status=1; fi
done
if grep -Eq "$genai_overview" <<<"$linked"; then
  echo "check-mlflow-ui: FAIL: the GenAI traces overview is shown at $base?workflowType=machine_learning" >&2; status=1
fi
[ $status = 0 ] && echo "check-mlflow-ui: ok: $base?workflowType=machine_learning shows the runs table"

# the address `posttrainllm ui` prints: the experiment's saved view (store.VIEW): points grouped by sweep, its columns
answer_url="http://127.0.0.1:$port/#/experiments/$experiment/runs?viewStateShareKey=posttrainllm-answer&workflowType=machine_learning"
answer=$(page "$answer_url")
for want in "sweep.changes" "verdict" "step.effect" "Group: ui-check" "ui-point-a"; do
  if ! grep -q "$want" <<<"$answer"; then echo "check-mlflow-ui: FAIL: '$want' not on $answer_url" >&2; status=1; fi
done
[ $status = 0 ] && echo "check-mlflow-ui: ok: $answer_url opens on the answer's columns, points grouped by sweep"

bare=$(page "$base")
if grep -Eq "$genai_overview" <<<"$bare"; then
  echo "check-mlflow-ui: note: the bare URL $base opens on the GenAI overview in a fresh browser" \
       "(MLflow $("$PYTHON" -c 'import mlflow; print(mlflow.__version__)') decides by its GenAI/Model training switch);" \
       "use ?workflowType=machine_learning or pick 'Model training' once in the sidebar"
else
  echo "check-mlflow-ui: note: the bare URL $base opens on the runs table"
fi
exit $status
