import pytest
import torch

from flowspec_p2p.errors import UnsupportedModel
from flowspec_p2p.model.arch import config_from_hf
from flowspec_p2p.model.blocks import rope_inv_freq

from ..conftest import tiny_hf_config


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModel, match="llama, mistral, qwen2"):
        config_from_hf({"model_type": "gpt2", "hidden_size": 8})


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "llama-untied"])
def test_config_flags_follow_the_family(kind):
    cfg = config_from_hf(tiny_hf_config(kind).to_dict())
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.tie_embeddings == (kind != "llama-untied")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_hf_config("llama3-rope")
    ours = rope_inv_freq(config_from_hf(hf.to_dict()))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert torch.equal(ours, theirs.float())
    assert not torch.equal(ours, rope_inv_freq(config_from_hf(tiny_hf_config("llama").to_dict())))
