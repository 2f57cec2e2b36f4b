"""Hugging Face interop (issue 13): import of a standard Qwen2ForCausalLM folder, publishable exports
(model card, no local paths, generation config, sharded weights) and the Qwen2 export on
transformers 4.x (a side install, see ``tf4_path``) against 5.x."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, child_env

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TF4 = "transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.5"


def random_qwen2(path, tie: bool, shard: str | None = None):
    """A randomly initialised transformers Qwen2 (GQA, rope_theta 50000, a vocabulary that is not a
    multiple of 128) saved to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rms_norm_eps=1e-6,
                      tie_word_embeddings=tie, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are zero-initialised: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(path), **kw)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_import_standard_qwen2_folder(tie, tmp_path, dist):
    """megahash import-hf on a transformers Qwen2 folder (sharded when untied): the imported
    checkpoint's logits equal transformers'."""
    from megahash.convert.importer import import_hf
    from megahash.training.weights import load_for_inference

    hf = random_qwen2(tmp_path / "hf", tie, shard=None if tie else "100KB")
    if not tie:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    res = import_hf(tmp_path / "hf", tmp_path / "run")
    assert res["format"] == "qwen2-hf" and res["step"] == 0
    cfg, model, _ = load_for_inference(str(tmp_path / "run"))
    assert cfg.model.rotary_base == 50000 and cfg.model.num_query_groups == 2 and cfg.model.tie_embeddings == tie
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)[..., :300].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
