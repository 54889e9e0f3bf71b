"""`accelerate launch -m hf_kvcompress.eval` with 2 CPU processes gathers what one process writes."""

import json
import os
import subprocess
import sys

from hf_kvcompress.eval.runner import VOLATILE_FIELDS

ARGS = ["--methods", "sink_window:sink_tokens=4,window=64", "--tasks", "needle", "--lengths", "260",
        "--depths", "50", "--chunk-size", "128", "--no-progress"]  # fmt: skip


def _results(folder):
    with open(folder / "results.jsonl") as handle:
        return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE_FIELDS} for line in handle]


def test_two_processes_give_the_single_process_results(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    subprocess.run([sys.executable, "-m", "hf_kvcompress.eval", *ARGS, "--out", str(single)], check=True, env=env,
                   capture_output=True, timeout=600)  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu", "-m", "hf_kvcompress.eval"]  # fmt: skip
    done = subprocess.run([*launch, *ARGS, "--out", str(sharded)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _results(sharded) == _results(single)
    assert len(_results(single)) == 2  # one sample x (dynamic + window): one batch per process
    assert not list(sharded.glob("results.rank*.jsonl"))  # per-process files merged away
    assert (sharded / "summary.md").exists() and (sharded / "heatmap_dynamic.png").exists()
