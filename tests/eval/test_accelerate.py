"""Two CPU processes under `accelerate launch --multi_gpu` and `torchrun` split the samples: each runs its share
once."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from hf_kvcompress.eval.runner import VOLATILE_FIELDS

WINDOW = "sink_window:sink_tokens=4,window=64"
# One sample at depths 0 and 100 x (dynamic + window): four batches, two per process.
ARGS = ["--methods", WINDOW, "--tasks", "needle", "--lengths", "260", "--depths", "0,100", "--chunk-size", "128",
        "--no-progress"]  # fmt: skip
LAUNCHERS = {
    "accelerate": ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_kvcompress.eval"],  # fmt: skip
    "torchrun": ["-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hf_kvcompress.eval"],
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _records(folder):
    with open(folder / "results.jsonl") as handle:
        return [json.loads(line) for line in handle]


def _stable(records):
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE_FIELDS} for r in records),
                  key=lambda r: (r["method"], r["sample_id"]))  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    subprocess.run([sys.executable, "-m", "hf_kvcompress.eval", *ARGS, "--out", str(out)], check=True, env=ENV,
                   capture_output=True, timeout=600)  # fmt: skip
    return _records(out)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_split_the_samples_and_merge_one_report(launcher, single, tmp_path):
    done = subprocess.run([sys.executable, *LAUNCHERS[launcher], *ARGS, "--out", str(tmp_path)], env=ENV,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path)
    # Each (method, sample) evaluated exactly once, two batches by each process.
    assert Counter((r["method"], r["sample_id"]) for r in records).most_common(1)[0][1] == 1
    assert Counter(r["process_index"] for r in records) == {0: 2, 1: 2}
    assert {r["process_index"] for r in single} == {0} and len(single) == 4
    assert _stable(records) == _stable(single)
    assert not list(tmp_path.glob("results.rank*.jsonl"))  # per-process files merged away
    assert (tmp_path / "summary.md").exists() and (tmp_path / "heatmap_dynamic.png").exists()
    assert done.stdout.count(" results (") == 1 and "4 evaluated now over 2 processes" in done.stdout
