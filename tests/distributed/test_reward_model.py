"""The reward-model role: scores at (t,p,d) = (2,1,1), (1,2,1), (1,1,2) equal the single-process
scores (<= 1e-5) and are the scalar head's value at each row's last token. An HF
LlamaForSequenceClassification (``reward_model.path``) scores as transformers does (<= 1e-4) at
tp=1 and tp=2: at the last non-pad token with a pad id (a row whose last real token is the pad
id is scored before it), and at lengths - 1 without one."""

import json

import torch
import transformers

from tests.distributed.launch import ROOT, torchrun

WORKER = "tests/distributed/reward_model_worker.py"
HF_TOL = 1e-4
LENGTHS = torch.tensor([12, 5, 9, 3])
PAD = 0


def make_hf_reward_models(work):
    """One random Llama sequence classifier saved twice: with pad_token_id 0 and without; next to
    each, transformers' scores of right-padded rows (``*.pt``)."""
    config = json.loads((ROOT / "configs" / "models" / "tiny-llama.json").read_text())
    torch.manual_seed(3)
    tokens = torch.randint(1, 256, (4, 12))
    tokens[1, 4] = PAD  # a real token equal to the pad id at the row's end
    tokens[torch.arange(12) >= LENGTHS.unsqueeze(1)] = PAD
    positions = torch.arange(12).expand(4, -1).contiguous()
    model = None
    for name, pad in (("llama-pad", PAD), ("llama-nopad", None)):
        hf_config = transformers.AutoConfig.for_model(**{**config, "pad_token_id": pad}, num_labels=1)
        if model is None:
            model = transformers.AutoModelForSequenceClassification.from_config(hf_config).eval()
        model.config.pad_token_id = pad
        model.save_pretrained(work / "hf_rm" / name)
        with torch.no_grad():
            if pad is None:  # transformers refuses padded batches without a pad id: one row at a time
                scores = torch.cat([model(tokens[i:i + 1, :n]).logits[:, 0] for i, n in enumerate(LENGTHS.tolist())])
            else:
                scores = model(tokens).logits[:, 0]
        torch.save({"tokens": tokens, "position_ids": positions, "lengths": LENGTHS, "scores": scores},
                   work / "hf_rm" / f"{name}.pt")
    assert "score.weight" in transformers.AutoModelForSequenceClassification.from_pretrained(
        work / "hf_rm" / "llama-pad").state_dict()


def test_reward_model_scores_across_layouts(tmp_path):
    make_hf_reward_models(tmp_path)
    out = torchrun(1, WORKER, "reference", str(tmp_path))
    out += torchrun(2, WORKER, "run", str(tmp_path), "2,1,1", "1,2,1", "1,1,2")
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    layouts = [r for r in results if "layout" in r]
    assert [r["layout"] for r in layouts] == ["2,1,1", "1,2,1", "1,1,2"]
    for r in layouts:
        assert r["max_abs_diff"] <= 1e-5, r
        assert r["last_token_diff"] == 0.0, r
    hf = [r for r in results if "hf" in r]
    assert sorted((r["hf"], r["tp"]) for r in hf) == [("llama-nopad", 1), ("llama-nopad", 2),
                                                      ("llama-pad", 1), ("llama-pad", 2)]
    for r in hf:
        assert r["max_abs_diff"] <= HF_TOL and r["scale"] > 1e-3, r
