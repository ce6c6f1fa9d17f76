"""The reward-model role: scores at (t,p,d) = (2,1,1), (1,2,1), (1,1,2) equal the single-process
scores (<= 1e-5) and are the scalar head's value at each row's last token."""

import json

from tests.distributed.launch import torchrun

WORKER = "tests/distributed/reward_model_worker.py"


def test_reward_model_scores_across_layouts(tmp_path):
    torchrun(1, WORKER, "reference", str(tmp_path))
    out = torchrun(2, WORKER, "run", str(tmp_path), "2,1,1", "1,2,1", "1,1,2")
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert [r["layout"] for r in results] == ["2,1,1", "1,2,1", "1,1,2"]
    for r in results:
        assert r["max_abs_diff"] <= 1e-5, r
        assert r["last_token_diff"] == 0.0, r
